// CosyStream keeper: the visitor's work stays in this browser, across a reload and a server restart.
//
// localStorage holds the form (text, transcript, mode, language, instruction, settings), the saved voice and
// the pronunciation lexicon picked last, the script desk and the history's entries (the server renders
// them with data-kept-history); IndexedDB holds audio: the prompt and the
// source speech as the visitor gave them, and each take's wav. Nothing here is sent anywhere but to this
// page's own server: a kept prompt goes back through Gradio's upload when the page is restored. The
// listeners' js hooks call in (layout.py, keep.py); nothing is saved before the stored values are back,
// so the page's first defaults never overwrite them.
(() => {
  "use strict";
  const FORM = "cosystream-form";
  const HISTORY = "cosystream-history";
  const SCRIPT = "cosystream-script"; // the script desk: {text, gap, names, voices}
  const VOICE = "cosystream-voice"; // the saved voice picked last (its id)
  const LEXICON = "cosystream-lexicon"; // the pronunciation lexicon picked last (its id)
  const NAMES = "cosystream-audio-names"; // kind -> file name, kept even when the blob could not be
  const DB = "cosystream", STORE = "files";
  const MAX_TAKES = 50; // as the server's history (handlers.MAX_HISTORY)
  const restored = { form: false, audio: false, history: false, voice: false, lexicon: false, script: false };
  let dbOpen = null;
  let lastKept = ""; // the last take whose wav is kept here

  function read(key, fallback) {
    try { const v = JSON.parse(localStorage.getItem(key)); return v === null ? fallback : v; } catch (e) { return fallback; }
  }

  function write(key, value) {
    try { localStorage.setItem(key, typeof value === "string" ? value : JSON.stringify(value)); } catch (e) { /* full: kept as before */ }
  }

  function db() {
    if (!dbOpen) {
      dbOpen = new Promise((resolve, reject) => {
        const req = indexedDB.open(DB, 1);
        req.onupgradeneeded = () => req.result.createObjectStore(STORE);
        req.onsuccess = () => resolve(req.result);
        req.onerror = () => reject(req.error);
      });
    }
    return dbOpen;
  }

  async function tx(mode, work) {
    const store = (await db()).transaction(STORE, mode).objectStore(STORE);
    return new Promise((resolve, reject) => {
      const req = work(store);
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error);
    });
  }

  const put = (key, value) => tx("readwrite", (s) => s.put(value, key));
  const get = (key) => tx("readonly", (s) => s.get(key)).catch(() => undefined);
  const drop = (key) => tx("readwrite", (s) => s.delete(key)).catch(() => undefined);
  const keys = () => tx("readonly", (s) => s.getAllKeys()).catch(() => []);

  // ---- the form ---------------------------------------------------------------------------------------
  function saveForm(names, values) {
    if (!restored.form) return;
    const form = {};
    names.forEach((name, i) => { form[name] = values[i]; });
    form.typed = !!window.cosyTyped; // the transcript holds the visitor's own words (player.js)
    write(FORM, form);
  }

  // Gradio mounts a component when its code has loaded, and a mounting component reports its first value:
  // a value set before that is lost. The restore waits for the kept fields' inputs to be on the page,
  // then for the frame after they are drawn.
  const FIELDS = ["#cosy-mode input", "#cosy-transcript textarea", "#cosy-lang input", "#cosy-text textarea",
    "#cosy-stream input", "#cosy-speed input", "#cosy-seed input", "#cosy-prompt", "#cosy-source"];

  function mounted(selectors, ceilingMs = 15000) {
    // (a ceiling, so a field the layout renamed costs its own value, never the rest of the restore)
    const all = () => selectors.every((s) => document.querySelector(s));
    return new Promise((resolve) => {
      const done = () => requestAnimationFrame(() => requestAnimationFrame(resolve));
      if (all()) { done(); return; }
      const watch = new MutationObserver(() => { if (all()) { watch.disconnect(); done(); } });
      watch.observe(document.documentElement, { childList: true, subtree: true });
      setTimeout(() => { watch.disconnect(); done(); }, ceilingMs);
    });
  }

  async function restoreForm(names, current) {
    await mounted(FIELDS);
    const form = read(FORM, null);
    restored.form = true;
    if (!form) return current;
    if (form.typed) window.cosyTyped = true;
    return names.map((name, i) => (form[name] === undefined || form[name] === null ? current[i] : form[name]));
  }

  // ---- the saved voice and the pronunciation lexicon ---------------------------------------------------
  // Their lists come from the server on load (this browser's own and the public ones): the kept id goes
  // there as an input, and the server picks it only while the list still has it (Studio.browser_voices,
  // Studio.browser_lexicons).
  function keptPick(key) {
    const id = read(key, "");
    return typeof id === "string" ? id : "";
  }

  function keepPick(key, kind, value) {
    if (!restored[kind]) return;
    if (typeof value === "string" && value) write(key, JSON.stringify(value));
    else { try { localStorage.removeItem(key); } catch (e) { /* nothing kept */ } }
  }

  const keptVoice = () => keptPick(VOICE);
  const keepVoice = (value) => keepPick(VOICE, "voice", value);
  function voiceRestored() { restored.voice = true; }
  const keptLexicon = () => keptPick(LEXICON);
  const keepLexicon = (value) => keepPick(LEXICON, "lexicon", value);
  function lexiconRestored() { restored.lexicon = true; }

  // ---- the script desk ---------------------------------------------------------------------------------
  // values: [text, gap, ...names, ...voices], `speakers` of each (script_tab.build's order)
  function saveScript(speakers, values) {
    if (!restored.script) return;
    write(SCRIPT, {
      text: values[0], gap: values[1],
      names: values.slice(2, 2 + speakers), voices: values.slice(2 + speakers, 2 + 2 * speakers),
    });
  }

  async function restoreScript(speakers, current) {
    // current: [text, gap, ...names]; the desk sits in a closed accordion: its fields are drawn when it
    // opens, with the values the load gave them
    await mounted(["#cosy-script"]);
    const kept = read(SCRIPT, null);
    restored.script = true;
    if (!kept || typeof kept !== "object") return current;
    const names = Array.isArray(kept.names) ? kept.names : [];
    const pick = (v, fallback, type) => (typeof v === type ? v : fallback);
    return [pick(kept.text, current[0], "string"), pick(kept.gap, current[1], "number"),
      ...current.slice(2).map((c, i) => pick(names[i], c, "string"))];
  }

  function scriptVoices() {
    const kept = read(SCRIPT, null);
    return kept && Array.isArray(kept.voices) ? kept.voices.map((v) => (typeof v === "string" ? v : null)) : [];
  }

  // ---- the prompt and the source speech -----------------------------------------------------------------
  async function keepAudio(kind, value) {
    if (!restored.audio) return;
    const names = read(NAMES, {});
    if (!value || !value.url) {
      delete names[kind]; write(NAMES, names);
      await drop("audio:" + kind);
      return;
    }
    const name = value.orig_name || (value.path || "").split("/").pop() || kind;
    const had = await get("audio:" + kind);
    if (had && had.url === value.url) return; // the same file the page restored
    names[kind] = name; write(NAMES, names);
    try {
      const resp = await fetch(value.url);
      if (!resp.ok) throw new Error(String(resp.status));
      await put("audio:" + kind, { blob: await resp.blob(), name, url: value.url });
    } catch (e) {
      await drop("audio:" + kind); // the name stays: the page asks for the file again (reuploadHint)
    }
  }

  async function upload(blob, name) {
    // Through Gradio's own upload route, as a file chosen by hand: the server answers with its path.
    const body = new FormData();
    body.append("files", new File([blob], name, { type: blob.type || "audio/wav" }));
    const resp = await fetch(new URL("gradio_api/upload", document.baseURI), { method: "POST", body });
    if (!resp.ok) throw new Error("upload: " + resp.status);
    const [path] = await resp.json();
    const url = new URL("gradio_api/file=" + path, document.baseURI).href;
    return { path, url, orig_name: name, size: blob.size, mime_type: blob.type, is_stream: false, meta: { _type: "gradio.FileData" } };
  }

  async function restoreAudio(kinds, current) {
    await mounted(FIELDS);
    const names = read(NAMES, {});
    const out = await Promise.all(kinds.map(async (kind, i) => {
      if (current[i] || !names[kind]) return current[i];
      const kept = await get("audio:" + kind);
      if (!kept) { reuploadHint(kind, names[kind]); return current[i]; }
      try {
        const value = await upload(kept.blob, kept.name);
        await put("audio:" + kind, { ...kept, url: value.url });
        return value;
      } catch (e) {
        reuploadHint(kind, names[kind]);
        return current[i];
      }
    }));
    restored.audio = true;
    return out;
  }

  function reuploadHint(kind, name) {
    // The file's name is known, its bytes were not kept (storage full or refused): ask for it again.
    const box = document.getElementById("cosy-" + kind);
    const live = document.getElementById("cosy-live");
    if (!box || !live || !live.dataset.textReupload) return;
    const note = document.createElement("div");
    note.className = "cosy-note cosy-bad cosy-reupload";
    note.textContent = live.dataset.textReupload.replace("{name}", name);
    box.before(note);
  }

  // ---- the history and its takes -----------------------------------------------------------------------
  function history() {
    restored.history = true;
    const json = localStorage.getItem(HISTORY) || "[]";
    showLastTake(json);
    return json;
  }

  async function showLastTake(json) {
    // The page came back (a reload, a new server): the last take plays and downloads from this browser.
    let last = null;
    try { last = JSON.parse(json).pop(); } catch (e) { return; }
    const kept = last && (await get("take:" + last.request_id));
    await mounted(["#cosy-live"]);
    if (kept && window.cosyPlayer) window.cosyPlayer.showKept(kept.blob, last.audio_s, takeName(last.request_id, kept.at));
  }

  let shownHistory = null; // the entries the server last rendered: saved when they change, not before

  function saveHistory() {
    if (!restored.history) return;
    const box = document.querySelector("[data-kept-history]");
    if (!box || box.dataset.keptHistory === shownHistory) return;
    const json = (shownHistory = box.dataset.keptHistory);
    write(HISTORY, json);
    let rids = [];
    try { rids = JSON.parse(json).map((e) => e.request_id); } catch (e) { return; }
    pruneTakes(rids.slice(-MAX_TAKES));
  }

  async function pruneTakes(rids) {
    const wanted = new Set(rids.map((r) => "take:" + r));
    for (const key of await keys()) if (String(key).startsWith("take:") && !wanted.has(key)) await drop(key);
  }

  function takeName(rid, at) {
    const d = new Date(at || Date.now()), p = (n) => String(n).padStart(2, "0");
    const stamp = `${d.getFullYear()}${p(d.getMonth() + 1)}${p(d.getDate())}-${p(d.getHours())}${p(d.getMinutes())}${p(d.getSeconds())}`;
    return `cosystream-${stamp}-${rid.slice(0, 8)}.wav`;
  }

  async function keepTake() {
    // After each take (Generate's event ended, or the server went away mid-take): its wav from the
    // server, or, when the server cannot give it, what the live player received.
    const player = window.cosyPlayer;
    const rid = player && player.take.rid;
    if (!rid) return;
    // a whole streamed take (the server said done, the player read the stream to its end): the page has
    // every sample already
    const done = document.querySelector('.cosy-status[data-state="done"]') && ["playing", "done"].includes(player.stats.state);
    let blob = done ? player.wav(rid) : null;
    let served = !!blob;
    if (!blob) {
      try {
        const resp = await fetch(new URL("webui/audio/" + rid + ".wav", document.baseURI), { cache: "no-store" });
        if (resp.ok) { blob = await resp.blob(); served = true; }
      } catch (e) { /* the server is gone: the player's copy below */ }
    }
    blob = blob || player.wav(rid);
    if (!blob) return;
    const at = Date.now();
    await put("take:" + rid, { blob, at }).catch(() => undefined);
    lastKept = rid;
    const failed = document.querySelector('.cosy-status[data-state="failed"]');
    const seconds = (blob.size - 44) / 2 / (player.take.rate || 24000);
    if (!served || failed) player.showKept(blob, seconds, takeName(rid, at));
    if (!served && window.cosyLink && window.cosyLink.down) keepLost(seconds);
  }

  function keepLost(seconds) {
    // A take the server went away during (no last word, so no history entry from it): the page writes
    // its entry from the form it was made with, marked failed, so it comes back with the page.
    const rid = window.cosyPlayer && window.cosyPlayer.take.rid;
    let entries = [];
    try { entries = JSON.parse(localStorage.getItem(HISTORY) || "[]"); } catch (e) { entries = []; }
    if (!rid || entries.some((e) => e.request_id === rid)) return;
    const form = read(FORM, {});
    entries.push({
      request_id: rid, created_at: Date.now() / 1000, mode: form.mode || "zero_shot",
      text: form.mode === "vc" ? "" : String(form.text || ""), language: form.language || "auto", voice: "—",
      speed: Number(form.speed) || 1, seed: Number.isInteger(Number(form.seed)) ? Number(form.seed) : -1, stream: !!form.stream,
      ttfa_ms: null, rtf: null, audio_s: seconds, stopped: true, failed: true,
    });
    write(HISTORY, JSON.stringify(entries.slice(-MAX_TAKES)));
  }

  function download(blob, name) {
    const url = URL.createObjectURL(blob);
    const a = document.createElement("a");
    a.href = url; a.download = name;
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000); // the download has its own copy by then
  }

  // A history link: the server's file while it has it (mp3 is made there), else the wav kept here.
  document.addEventListener("click", (e) => {
    const link = e.target instanceof Element && e.target.closest(".cosy-history-box a[href*='webui/audio/']");
    if (!link) return;
    const m = link.getAttribute("href").match(/([0-9a-f]{32})\.(wav|mp3)$/);
    if (!m) return;
    e.preventDefault();
    (async () => {
      const kept = await get("take:" + m[1]);
      let resp = null;
      try { resp = await fetch(link.href, { cache: "no-store" }); } catch (err) { resp = null; }
      if (resp && resp.ok) { download(await resp.blob(), takeName(m[1], kept && kept.at).replace(/wav$/, m[2])); return; }
      if (kept) download(kept.blob, takeName(m[1], kept.at));
    })();
  }, { capture: true });

  new MutationObserver(saveHistory).observe(document.documentElement, {
    childList: true, subtree: true, attributes: true, attributeFilter: ["data-kept-history"],
  });

  window.cosyKeep = { saveForm, restoreForm, keepAudio, keptVoice, keepVoice, voiceRestored,
    keptLexicon, keepLexicon, lexiconRestored,
    saveScript, restoreScript, scriptVoices, restoreAudio, history, keepTake,
    get restored() { return { ...restored }; }, get lastKept() { return lastKept; } };
})();
