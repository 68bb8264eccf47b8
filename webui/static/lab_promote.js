// A take promoted from the prompt lab (/lab) arrives as "#lab=<base64url JSON>" on the studio's address:
// fill the studio's text, language, mode, instruction, seed and speed once its form is on the page, then
// pick the take's voice (its card's "use": Saved voice mode for a zero-shot take) and its lexicon.
(() => {
  "use strict";
  const m = location.hash.match(/^#lab=([A-Za-z0-9_-]+)/);
  if (!m) return;
  let data;
  try {
    const bin = atob(m[1].replace(/-/g, "+").replace(/_/g, "/"));
    data = JSON.parse(new TextDecoder().decode(Uint8Array.from(bin, (c) => c.charCodeAt(0))));
  } catch (_) {
    return;
  }
  const set = (input, value) => {
    if (!input || value === null || value === undefined) return;
    input.value = String(value);
    input.dispatchEvent(new Event("input", { bubbles: true }));
    input.dispatchEvent(new Event("change", { bubbles: true }));
    input.dispatchEvent(new Event("blur", { bubbles: true }));
  };
  const stuck = () => {
    const text = document.querySelector("#cosy-text textarea");
    const mode = modeInput();
    return text && text.value === String(data.text) && (!mode || mode.checked);
  };
  // a zero-shot take of a saved or example voice is the studio's Saved voice mode
  const card = () => data.voice
    ? [...document.querySelectorAll('#cosy-examples [data-lib-op="use"]')].find((b) => b.dataset.voice === data.voice)
    : null;
  const studioMode = () => (data.mode === "zero_shot" && card() ? "voice" : data.mode);
  const modeInput = () => document.querySelector(`#cosy-mode input[value="${studioMode()}"]`);
  const fill = () => {
    const text = document.querySelector("#cosy-text textarea");
    const mode = modeInput();
    if (mode && !mode.checked) mode.click();
    set(text, data.text);
    set(document.querySelector("#cosy-instruct textarea"), data.instruct || "");
    const rows = document.querySelectorAll(".cosy-settings");
    if (rows.length >= 2) {
      set(rows[0].querySelector("input[type=number]"), data.speed);
      set(rows[1].querySelector("input[type=number]"), data.seed ?? -1);
    }
  };
  // once the page's load events are done (they refill the voice and lexicon lists): the voice through its
  // library card (library.js), the lexicon through the unseen #cosy-lex-go button (Studio.pick_lexicon)
  const pick = () => {
    const use = card();
    if (use) use.click();
    const go = document.getElementById("cosy-lex-go");
    if (data.lexicon && go) {
      window.cosyLexPick = String(data.lexicon);
      go.click();
    }
  };
  // the page's load events (the session's language, the browser's voices) may re-render the form after it
  // first shows: fill it, and again whenever it lost the text, until the text has stayed for ~3 s
  let settled = 0;
  const timer = setInterval(() => {
    if (!document.querySelector("#cosy-text textarea")) return;
    if (stuck()) settled += 1;
    else { settled = 0; fill(); }
    if (settled >= 8) {
      clearInterval(timer);
      history.replaceState(null, "", location.pathname + location.search);
      pick();
      window.cosyLabPromoted = data;
    }
  }, 400);
  setTimeout(() => clearInterval(timer), 60000);
})();
