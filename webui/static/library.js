// The voice library's cards (webui/voice_library.py): play a voice's recording, use it, rename or delete it.
// Play is the browser's alone (one <audio> for the page, GET webui/voice/<id>?owner=<browser id>); an
// example used in a prompt mode clicks its hidden example chip, Gradio's own fill; every other action goes
// as JSON (window.cosyLibAction) through the unseen #cosy-lib-go button's click to VoiceShelf.act.
(() => {
  "use strict";
  let audio = null;
  let playing = "";

  function browserId() {
    return window.cosyBrowserId ? window.cosyBrowserId() : ""; // static/browser_id.js
  }

  function mode() {
    const picked = document.querySelector('#cosy-mode input[aria-checked="true"]');
    return picked ? picked.value : "zero_shot";
  }

  function send(action) {
    const go = document.getElementById("cosy-lib-go");
    if (!go) return;
    window.cosyLibAction = JSON.stringify(action); // read by the button's js hook (layout.py)
    go.click();
  }

  function mark(id) {
    playing = id;
    for (const card of document.querySelectorAll("#cosy-examples .cosy-vcard")) {
      card.toggleAttribute("data-playing", card.dataset.voice === id);
    }
  }

  function play(id) {
    if (!audio) {
      audio = new Audio();
      audio.addEventListener("ended", () => mark(""));
      audio.addEventListener("error", () => mark(""));
    }
    if (playing === id && !audio.paused) { audio.pause(); mark(""); return; }
    const url = new URL("webui/voice/" + encodeURIComponent(id), document.baseURI);
    url.searchParams.set("owner", browserId());
    audio.src = url.toString();
    audio.play().then(() => mark(id), () => mark(""));
  }

  function use(button) {
    const id = button.dataset.voice;
    if (button.dataset.kind === "example" && mode() !== "voice") {
      const name = button.textContent.trim();
      const chip = [...document.querySelectorAll("#cosy-example-fill button")]
        .find((b) => b.textContent.trim() === name);
      if (chip) { chip.click(); return; }
    }
    send({ op: "use", voice: id });
  }

  document.addEventListener("click", (event) => {
    const button = event.target instanceof Element && event.target.closest("#cosy-examples [data-lib-op]");
    if (!button) return;
    event.preventDefault();
    const op = button.dataset.libOp, id = button.dataset.voice;
    if (op === "play") play(id);
    else if (op === "use") use(button);
    else if (op === "rename") {
      const card = button.closest(".cosy-vcard");
      const old = card ? card.querySelector(".cosy-vname").textContent.trim() : "";
      const root = button.closest(".cosy-lib");
      const name = window.prompt(root ? root.dataset.rename : "", old);
      if (name && name.trim() && name.trim() !== old) send({ op, voice: id, name: name.trim() });
    } else send({ op, voice: id });
  });
})();
