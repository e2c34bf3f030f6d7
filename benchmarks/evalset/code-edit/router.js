"use strict";
// Request routing for the notes API (plain Node http, no framework).
const { URL } = require("url");

const routes = [];

function route(method, pattern, handler) {
  const keys = [];
  const source = pattern.replace(/:([a-zA-Z]+)/g, (_, key) => {
    keys.push(key);
    return "([^/]+)";
  });
  routes.push({ method, regex: new RegExp("^" + source + "$"), keys, handler });
}

function match(method, pathname) {
  for (const r of routes) {
    if (r.method !== method) continue;
    const m = r.regex.exec(pathname);
    if (m) {
      const params = {};
      r.keys.forEach((key, i) => {
        params[key] = decodeURIComponent(m[i + 1]);
      });
      return { handler: r.handler, params };
    }
  }
  return null;
}

function send(res, status, body) {
  res.writeHead(status, { "Content-Type": "application/json" });
  res.end(JSON.stringify(body));
}

// Legacy v0 endpoints, kept for the old mobile client until it is retired.
// They answer with the v1 handlers' data under the old field names.
function legacyNote(note) {
  return { note_id: note.id, note_title: note.title, note_body: note.body };
}

route("GET", "/v0/notes", (req, res, params, store) => {
  send(res, 200, store.list().map(legacyNote));
});

route("GET", "/v0/note/:id", (req, res, params, store) => {
  const note = store.get(params.id);
  if (!note) return send(res, 404, { error: "not found" });
  send(res, 200, legacyNote(note));
});
// End of legacy v0 endpoints.

route("GET", "/v1/notes", (req, res, params, store) => {
  send(res, 200, store.list());
});

route("GET", "/v1/notes/:id", (req, res, params, store) => {
  const note = store.get(params.id);
  if (!note) return send(res, 404, { error: "not found" });
  send(res, 200, note);
});

route("DELETE", "/v1/notes/:id", (req, res, params, store) => {
  const removed = store.remove(params.id);
  send(res, removed ? 204 : 404, removed ? {} : { error: "not found" });
});

function createHandler(store) {
  return (req, res) => {
    const url = new URL(req.url, "http://localhost");
    const found = match(req.method, url.pathname);
    if (!found) {
      return send(res, 404, { error: `no route for ${req.method} ${url.pathname}` });
    }
    try {
      found.handler(req, res, found.params, store);
    } catch (err) {
      send(res, 500, { error: String(err.message || err) });
    }
  };
}

module.exports = { createHandler, route, match };
