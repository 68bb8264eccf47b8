// The browser's id: the namespace of its own voices and lexicons, 128 random bits as 32 hex digits kept in
// localStorage. Drawn here on the first visit and read back after, by the studio (handlers.OWNER_JS,
// library.js) and the prompt lab (lab.js) alike, so both pages of one browser name the same owner. The
// server never guesses one: it takes an id of this form (stream_route.BROWSER_ID) or none.
(() => {
  "use strict";
  const KEY = "cosystream-browser-id";
  const FORM = /^[0-9a-f]{32}$/;

  window.cosyBrowserId = function cosyBrowserId() {
    let id = null;
    try { id = localStorage.getItem(KEY); } catch (e) { id = null; } // storage refused: a new id per page
    if (id && FORM.test(id)) return id;
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    id = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    try { localStorage.setItem(KEY, id); } catch (e) { /* not kept: this page still has one */ }
    return id;
  };
})();
