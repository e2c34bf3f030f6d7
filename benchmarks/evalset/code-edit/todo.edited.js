// A to-do list widget: renders items into a <ul> and keeps them in localStorage.
const STORAGE_KEY = "todo-items";

function loadItems() {
  const raw = window.localStorage.getItem(STORAGE_KEY);
  if (!raw) {
    return [];
  }
  try {
    return JSON.parse(raw);
  } catch (err) {
    console.warn("discarding corrupt to-do list", err);
    return [];
  }
}

function saveItems(items) {
  window.localStorage.setItem(STORAGE_KEY, JSON.stringify(items));
}

function createItem(text) {
  return { id: Date.now().toString(36), text: text.trim(), done: false };
}

function renderItem(item, onToggle, onRemove) {
  const li = document.createElement("li");
  const box = document.createElement("input");
  const label = document.createElement("span");
  const remove = document.createElement("button");
  box.type = "checkbox";
  box.checked = item.done;
  box.addEventListener("change", () => {
    onToggle(item.id);
  });
  label.textContent = item.text;
  if (item.done) {
    label.className = "done";
  }
  remove.textContent = "\u00d7";
  remove.addEventListener("click", () => {
    onRemove(item.id);
  });
  li.appendChild(box);
  li.appendChild(label);
  li.appendChild(remove);
  return li;
}

function TodoList(root) {
  let items = loadItems();
  const list = root.querySelector("ul");
  const form = root.querySelector("form");

  function render() {
    list.innerHTML = "";
    items.forEach((item) => {
      list.appendChild(renderItem(item, toggle, removeItem));
    });
    root.querySelector(".count").textContent = items.filter((i) => !i.done).length + " left";
  }

  function toggle(id) {
    items = items.map((i) => (i.id === id ? { ...i, done: !i.done } : i));
    saveItems(items);
    render();
  }

  function removeItem(id) {
    items = items.filter((i) => i.id !== id);
    saveItems(items);
    render();
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const input = form.querySelector("input");
    if (input.value.trim()) {
      items.push(createItem(input.value));
      input.value = "";
      saveItems(items);
      render();
    }
  });

  render();
}
