// CosyStream link: the page's line to its server, a WebSocket to webui/alive (stream_route.py).
//
// The server names its process on the socket ({"instance": ...}); the socket's close says it went away
// (a stopping server closes it with 1012, a killed one drops it). While it is away the page shows a
// banner, Generate and Retry are disabled and a take in flight is kept (keep.js); the page reconnects by
// itself, sooner and sooner apart at first and then every few seconds (and at once when the browser says
// it is online again). A server that comes back as a new process has none of this page's state: the page
// reloads, and keep.js puts back what the visitor had.
(() => {
  "use strict";
  const FIRST_MS = 250, MAX_MS = 4000;
  let instance = "", delay = FIRST_MS, timer = null, socket = null, down = false;
  let lost = false; // the server went away during a take: no last word will come for it

  function banner(show) {
    let el = document.getElementById("cosy-offline");
    if (show && !el) {
      const live = document.getElementById("cosy-live");
      el = document.createElement("div");
      el.id = "cosy-offline"; el.className = "cosy-offline"; el.setAttribute("role", "alert");
      el.textContent = (live && live.dataset.textConnDown) || "The server cannot be reached.";
      document.body.prepend(el);
    } else if (!show && el) {
      el.remove();
    }
    document.body.classList.toggle("cosy-is-offline", show);
    for (const id of ["cosy-generate", "cosy-retry"]) {
      const button = document.getElementById(id);
      if (button) { button.disabled = show; button.setAttribute("aria-disabled", String(show)); }
    }
  }

  function setDown(now) {
    if (now === down) return;
    down = now;
    banner(now);
    const player = window.cosyPlayer;
    if (now && player && ["waiting", "streaming", "playing"].includes(player.stats.state) && window.cosyKeep) {
      window.cosyKeep.keepTake(); // the server went away mid-take: keep what was heard
      lost = true;
      lostTake();
    }
    if (!now) lost = false;
  }

  function lostTake() {
    // No answer will end this take (a killed server says nothing): the status says so itself, unless the
    // server's own last word (failed, stopped, done) is already there. Gradio redraws the status when it
    // gives the event up: the observer below puts this back.
    const status = document.querySelector(".cosy-status");
    const live = document.getElementById("cosy-live");
    if (!status || !live || !["idle", "waiting", "running"].includes(status.dataset.state)) return;
    // nothing heard yet (it went before the first chunk): nothing is kept, and the line says so
    const heard = window.cosyPlayer && window.cosyPlayer.take.bytes > 0;
    const text = heard ? live.dataset.textLost : live.dataset.textNoAnswer;
    if (!text) return;
    status.dataset.state = "failed";
    status.textContent = text;
  }

  function connect() {
    timer = null;
    const url = new URL("webui/alive", document.baseURI);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const ws = (socket = new WebSocket(url));
    ws.onmessage = (e) => {
      let said = null;
      try { said = JSON.parse(e.data); } catch (err) { return; }
      if (!said || !said.instance) return; // a stopping server's refusal: the close follows
      if (instance && said.instance !== instance) { window.location.reload(); return; }
      instance = said.instance; delay = FIRST_MS;
      setDown(false);
    };
    ws.onclose = () => {
      if (socket === ws) socket = null;
      // only a line that once worked says the server is away: a proxy that passes no WebSocket must not
      // keep a working page under the banner (the page then simply has no banner)
      if (instance) setDown(true);
      retry();
    };
  }

  function retry() {
    if (timer || socket) return;
    timer = setTimeout(connect, delay);
    delay = Math.min(delay * 2, MAX_MS);
  }

  window.addEventListener("online", () => {
    if (timer) { clearTimeout(timer); timer = null; }
    delay = FIRST_MS;
    if (!socket) connect();
  });

  // Gradio re-renders Generate (its disabled state with it) on its own updates: while away, hold it.
  new MutationObserver(() => { if (down) banner(true); if (lost) lostTake(); }).observe(document.documentElement, { childList: true, subtree: true });

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", connect, { once: true });
  else connect();

  window.cosyLink = { get down() { return down; }, get instance() { return instance; } };
})();
