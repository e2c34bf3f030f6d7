// A to-do list widget: renders items into a <ul> and keeps them in localStorage.
var STORAGE_KEY = "todo-items";

function loadItems() {
  var raw = window.localStorage.getItem(STORAGE_KEY);
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
  var li = document.createElement("li");
  var box = document.createElement("input");
  var label = document.createElement("span");
  var remove = document.createElement("button");
  box.type = "checkbox";
  box.checked = item.done;
  box.addEventListener("change", function () {
    onToggle(item.id);
  });
  label.textContent = item.text;
  if (item.done) {
    label.className = "done";
  }
  remove.textContent = "\u00d7";
  remove.addEventListener("click", function () {
    onRemove(item.id);
  });
  li.appendChild(box);
  li.appendChild(label);
  li.appendChild(remove);
  return li;
}

function TodoList(root) {
  var items = loadItems();
  var list = root.querySelector("ul");
  var form = root.querySelector("form");

  function render() {
    list.innerHTML = "";
    items.forEach(function (item) {
      list.appendChild(renderItem(item, toggle, removeItem));
    });
    root.querySelector(".count").textContent = items.filter(function (i) {
      return !i.done;
    }).length + " left";
  }

  function toggle(id) {
    items = items.map(function (i) {
      return i.id === id ? Object.assign({}, i, { done: !i.done }) : i;
    });
    saveItems(items);
    render();
  }

  function removeItem(id) {
    items = items.filter(function (i) {
      return i.id !== id;
    });
    saveItems(items);
    render();
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    var input = form.querySelector("input");
    if (input.value.trim()) {
      items.push(createItem(input.value));
      input.value = "";
      saveItems(items);
      render();
    }
  });

  render();
}
