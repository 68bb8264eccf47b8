// The prompt lab (webui/lab_route.py serves it at /lab): takes side by side, blind rating, lexicons, copy as
// code, share links and batches. Every request carries the studio's browser id (X-Cosy-Browser), so the lab
// sees the public voices and lexicons and this browser's own. window.labState is read by the browser tests.
(() => {
  "use strict";
  const T = window.LAB_TEXTS;
  const $ = (id) => document.getElementById(id);
  const LETTERS = "ABCDEFGH";
  const fmt = (key, vars = {}) => T[key].replace(/\{(\w+)\}/g, (_, k) => String(vars[k] ?? ""));
  const state = (window.labState = {
    cfg: null, rows: [], results: [], blind: false, order: [], revealed: false, codeFor: null,
    code: null, codeTab: "python", playing: null, batch: null,
  });

  const BROWSER = window.cosyBrowserId(); // static/browser_id.js, as the studio's

  async function call(path, options = {}) {
    const headers = { "X-Cosy-Browser": BROWSER, ...(options.headers || {}) };
    if (options.json !== undefined) {
      headers["Content-Type"] = "application/json";
      options = { ...options, body: JSON.stringify(options.json) };
    }
    const response = await fetch(path, { ...options, headers });
    if (!response.ok) {
      let message = `${response.status}`;
      try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    return response;
  }

  function notice(message, kind = "info") {
    const box = $("lab-notice");
    box.textContent = message;
    box.dataset.kind = kind;
    box.hidden = !message;
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== false && v !== null && v !== undefined) node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  // ------------------------------------------------------------------------------------------ settings
  function voiceName(id) {
    const v = state.cfg.voices.find((x) => x.id === id);
    return v ? v.name : id;
  }
  function voiceOptions(select, withBase) {
    select.replaceChildren();
    if (withBase) select.append(el("option", { value: "" }, "—"));
    for (const v of state.cfg.voices) {
      const tag = v.public ? "" : " 🔒";
      select.append(el("option", { value: v.id }, v.name + tag));
    }
  }
  function base() {
    const seed = $("lab-seed").value.trim();
    return {
      input: $("lab-text").value,
      voice: $("lab-voice").value,
      mode: $("lab-mode").value,
      instructions: $("lab-instruct").value.trim(),
      seed: seed === "" ? null : Number(seed),
      speed: Number($("lab-speed").value || 1),
      language: $("lab-language").value,
      lexicon: $("lab-lexicon").value || null,
    };
  }
  function resolve(row) {
    const b = base();
    const s = { ...b };
    if (row.voice) s.voice = row.voice;
    if (row.instruct) { s.instructions = row.instruct; s.mode = "instruct"; }
    if (row.seed !== "" && row.seed !== undefined && row.seed !== null) s.seed = Number(row.seed);
    if (row.speed) s.speed = Number(row.speed);
    return s;
  }
  function body(s) {
    const out = { input: s.input, voice: s.voice, mode: s.mode, language: s.language, speed: s.speed,
      response_format: "wav", stream: false };
    if (s.mode === "instruct") out.instructions = s.instructions;
    if (s.seed !== null && s.seed !== undefined) out.seed = s.seed;
    if (s.lexicon) out.lexicon = s.lexicon;
    return out;
  }

  // ------------------------------------------------------------------------------------------ take rows
  function drawRows() {
    const box = $("lab-takes");
    box.replaceChildren();
    state.rows.forEach((row, i) => {
      const voice = el("select", { "aria-label": `${T.voice} ${LETTERS[i]}` });
      voiceOptions(voice, true);
      voice.value = row.voice || "";
      voice.addEventListener("change", () => { row.voice = voice.value; });
      const instruct = el("input", { placeholder: T.instruct, value: row.instruct || "", "aria-label": `${T.instruct} ${LETTERS[i]}` });
      instruct.addEventListener("input", () => { row.instruct = instruct.value.trim(); });
      const seed = el("input", { type: "number", min: "0", placeholder: T.seed, value: row.seed ?? "", "aria-label": `${T.seed} ${LETTERS[i]}` });
      seed.addEventListener("input", () => { row.seed = seed.value.trim(); });
      const speed = el("input", { type: "number", min: "0.5", max: "2", step: "0.05", placeholder: T.speed, value: row.speed || "", "aria-label": `${T.speed} ${LETTERS[i]}` });
      speed.addEventListener("input", () => { row.speed = speed.value.trim(); });
      const remove = el("button", { type: "button", class: "lab-x", title: T.remove, onclick: () => {
        if (state.rows.length > 2) { state.rows.splice(i, 1); drawRows(); }
      } }, "×");
      box.append(el("div", { class: "lab-take-row", "data-take": LETTERS[i] }, el("b", {}, LETTERS[i]), voice, instruct, seed, speed, remove));
    });
    $("lab-add").disabled = state.rows.length >= state.cfg.limits.max_takes;
  }

  // ------------------------------------------------------------------------------------------ takes
  async function render(result) {
    result.status = "running";
    result.error = "";
    drawResults();
    const started = performance.now();
    try {
      const response = await call("/lab/speech", { method: "POST", json: body(result.asked) });
      const h = (k) => response.headers.get(k);
      const blob = await response.blob();
      if (result.url) URL.revokeObjectURL(result.url);
      result.url = URL.createObjectURL(blob);
      result.settings = { ...result.asked, seed: Number(h("X-Seed")) };
      result.metrics = { ttfa_ms: Number(h("X-TTFA-Ms")), rtf: Number(h("X-RTF")), seconds: Number(h("X-Audio-Seconds")),
        wall_ms: Math.round(performance.now() - started) };
      result.applied = h("X-Lexicon-Applied") ? JSON.parse(h("X-Lexicon-Applied")) : null;
      result.peaks = await peaks(blob);
      result.status = "done";
    } catch (err) {
      result.status = "failed";
      result.error = err.message;
    }
    drawResults();
  }

  async function peaks(blob) {
    try {
      const ctx = new (window.OfflineAudioContext || window.webkitOfflineAudioContext)(1, 1, 24000);
      const audio = await ctx.decodeAudioData(await blob.arrayBuffer());
      const data = audio.getChannelData(0);
      const n = 240, step = Math.max(1, Math.floor(data.length / n)), out = [];
      for (let i = 0; i < n; i++) {
        let hi = 0;
        for (let j = i * step; j < Math.min(data.length, (i + 1) * step); j++) hi = Math.max(hi, Math.abs(data[j]));
        out.push(hi);
      }
      return out;
    } catch (_) {
      return [];
    }
  }

  async function generate() {
    const b = base();
    if (!b.input.trim()) return notice(T.need_text, "error");
    if (!b.voice && !state.rows.every((r) => r.voice)) return notice(T.need_voice, "error");
    notice("");
    stopPlaying();
    state.blind = $("lab-blind").checked;
    state.revealed = !state.blind;
    state.results = state.rows.map((row, i) => ({ label: LETTERS[i], row: { ...row }, asked: resolve(row), rating: 0, favourite: false }));
    state.order = state.results.map((_, i) => i);
    if (state.blind) shuffle(state.order);
    $("lab-results-card").hidden = false;
    $("lab-reveal").hidden = !state.blind;
    $("lab-status").textContent = fmt("generating", { n: state.results.length });
    // all at once: the engine batches requests that are in flight together
    await Promise.all(state.results.map(render));
    $("lab-status").textContent = "";
  }

  function shuffle(a) {
    for (let i = a.length - 1; i > 0; i--) {
      const j = Math.floor(Math.random() * (i + 1));
      [a[i], a[j]] = [a[j], a[i]];
    }
    if (a.length > 1 && a.every((v, i) => v === i)) a.push(a.shift()); // never the plain order
  }

  const SHOWN = ["voice", "mode", "instructions", "seed", "speed", "language", "lexicon"];
  function differing() {
    const keys = new Set();
    for (const k of SHOWN) {
      const values = new Set(state.results.map((r) => JSON.stringify((r.settings || r.asked)[k] ?? null)));
      if (values.size > 1) keys.add(k);
    }
    return keys;
  }

  function drawResults() {
    const box = $("lab-results");
    box.replaceChildren();
    const diff = differing();
    state.order.forEach((index, position) => {
      const r = state.results[index];
      box.append(card(r, index, position, diff));
    });
    $("lab-results").dataset.done = String(state.results.length > 0 && state.results.every((r) => r.status === "done" || r.status === "failed"));
  }

  function card(r, index, position, diff) {
    const hidden = state.blind && !state.revealed;
    const title = hidden ? fmt("hidden_take", { n: position + 1 }) : fmt("take", { label: r.label });
    const s = r.settings || r.asked;
    const node = el("article", { class: "lab-result", "data-index": index, "data-state": r.status || "" });
    const head = el("header", {}, el("b", {}, title));
    if (r.favourite) head.append(el("span", { class: "lab-star", title: T.favourite }, "★"));
    if (state.revealed && state.blind && winner() === index) head.append(el("span", { class: "lab-win" }, T.winner));
    node.append(head);
    if (!hidden) {
      const list = el("dl", { class: "lab-settings" });
      for (const k of SHOWN) {
        let v = s[k];
        if (k === "voice") v = voiceName(v);
        if (k === "mode") v = T["mode_" + v] || v;
        if (k === "language") v = T["lang_" + v] || v;
        if (k === "instructions" && s.mode !== "instruct") continue;
        if (v === null || v === undefined || v === "") continue;
        list.append(el("div", { class: diff.has(k) ? "lab-diff" : "" }, el("dt", {}, T[k === "instructions" ? "instruct" : k] || k), el("dd", {}, v)));
      }
      node.append(list);
    }
    const canvas = el("canvas", { class: "lab-wave", width: "480", height: "64" });
    node.append(canvas);
    if (r.peaks) requestAnimationFrame(() => drawWave(canvas, r.peaks));
    if (r.error) node.append(el("p", { class: "lab-error" }, r.error));
    if (r.url) {
      const audio = el("audio", { controls: true, src: r.url, preload: "auto" });
      audio.addEventListener("play", () => { state.playing = index; markPlayed(r); pauseOthers(audio); });
      node.append(audio);
      const m = r.metrics;
      node.append(el("div", { class: "lab-metrics" },
        el("span", {}, `${T.ttfa} ${m.ttfa_ms.toFixed(0)} ms`),
        el("span", {}, `${T.rtf} ${Number.isFinite(m.rtf) ? m.rtf.toFixed(3) : "—"}`),
        el("span", {}, `${T.duration} ${m.seconds.toFixed(2)} s`)));
      if (r.applied && Object.keys(r.applied).length) {
        const words = Object.entries(r.applied).map(([w, n]) => `${w}×${n}`).join(", ");
        node.append(el("p", { class: "lab-help lab-applied" }, `${T.applied}: ${words}`));
      }
    }
    if (state.blind && !state.revealed) {
      const rate = el("div", { class: "lab-rate", role: "radiogroup", "aria-label": T.rating });
      for (let n = 1; n <= 5; n++) {
        rate.append(el("button", { type: "button", class: r.rating >= n ? "on" : "", "aria-label": `${T.rating} ${n}`,
          onclick: () => { r.rating = n; drawResults(); } }, "★"));
      }
      node.append(rate);
    } else if (state.blind) {
      node.append(el("p", { class: "lab-help" }, `${T.rating}: ${r.rating || "—"}`));
    }
    const actions = el("div", { class: "lab-card-actions" },
      el("button", { type: "button", "data-act": "play", onclick: () => play(index) }, T.play),
      el("button", { type: "button", "data-act": "favourite", "aria-pressed": String(!!r.favourite), onclick: () => { r.favourite = !r.favourite; drawResults(); } }, `${r.favourite ? "★" : "☆"} ${T.favourite}`),
      el("button", { type: "button", "data-act": "regenerate", onclick: () => regenerate(r) }, T.regenerate));
    if (!hidden) {
      actions.append(
        el("button", { type: "button", "data-act": "promote", onclick: () => promote(r) }, T.promote),
        el("button", { type: "button", "data-act": "code", onclick: () => showCode(r) }, T.code));
    }
    node.append(actions);
    return node;
  }

  // another draw of the same settings: a new seed (the same seed would give the same audio)
  function regenerate(r) {
    r.asked = { ...(r.settings || r.asked), seed: Math.floor(Math.random() * 1e9) };
    r.rating = 0;
    return render(r);
  }

  function drawWave(canvas, values) {
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    ctx.fillStyle = "#7c3aed";
    const top = Math.max(1e-6, ...values);
    const bar = w / Math.max(1, values.length);
    values.forEach((v, i) => {
      const y = (v / top) * (h / 2 - 2);
      ctx.fillRect(i * bar, h / 2 - y, Math.max(1, bar - 0.5), 2 * y + 1);
    });
  }

  function markPlayed(r) { r.played = (r.played || 0) + 1; }
  function pauseOthers(except) {
    document.querySelectorAll("#lab-results audio").forEach((a) => { if (a !== except) a.pause(); });
  }
  function audioOf(index) { return document.querySelector(`#lab-results .lab-result[data-index="${index}"] audio`); }
  function play(index) {
    const audio = audioOf(index);
    if (!audio) return Promise.resolve();
    audio.currentTime = 0;
    return audio.play().catch(() => {});
  }
  function stopPlaying() {
    state.playAll = false;
    pauseOthers(null);
    $("lab-play-all").textContent = T.play_all;
  }
  async function playAll() {
    if (state.playAll) return stopPlaying();
    state.playAll = true;
    $("lab-play-all").textContent = T.stop;
    for (const index of state.order) {
      if (!state.playAll) break;
      const audio = audioOf(index);
      if (!audio) continue;
      const ended = new Promise((done) => {
        audio.addEventListener("ended", done, { once: true });
        audio.addEventListener("pause", done, { once: true });
      });
      await play(index);
      await ended;
    }
    stopPlaying();
  }

  function winner() {
    let best = -1, top = 0;
    state.results.forEach((r, i) => { if (r.rating > top) { top = r.rating; best = i; } });
    return best;
  }
  function reveal() {
    state.revealed = true;
    $("lab-reveal").hidden = true;
    const w = winner();
    if (w >= 0) {
      const s = state.results[w].settings || state.results[w].asked;
      $("lab-status").textContent = `${T.winner}: ${fmt("take", { label: state.results[w].label })} · ${voiceName(s.voice)} · ${T.seed} ${s.seed} · ${T.speed} ${s.speed}` + (s.mode === "instruct" ? ` · ${s.instructions}` : "");
    }
    drawResults();
  }

  // ------------------------------------------------------------------------------------------ export
  function rows() {
    return state.order.map((index, position) => {
      const r = state.results[index];
      const s = r.settings || r.asked;
      return { take: r.label, position: position + 1, blind: state.blind, rating: r.rating || null,
        model: state.cfg.model, llm_variant: state.cfg.llm_variant || "",
        favourite: !!r.favourite, winner: winner() === index, voice: s.voice, voice_name: voiceName(s.voice), mode: s.mode,
        instructions: s.mode === "instruct" ? s.instructions : "", seed: s.seed, speed: s.speed, language: s.language,
        lexicon: s.lexicon || "", text: s.input, ttfa_ms: r.metrics ? r.metrics.ttfa_ms : null,
        rtf: r.metrics ? r.metrics.rtf : null, seconds: r.metrics ? r.metrics.seconds : null, error: r.error || "" };
    });
  }
  function csv(list) {
    const keys = Object.keys(list[0] || {});
    const cell = (v) => { const s = v === null || v === undefined ? "" : String(v); return /[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s; };
    return [keys.join(","), ...list.map((row) => keys.map((k) => cell(row[k])).join(","))].join("\n") + "\n";
  }
  function download(name, text, type) {
    const a = el("a", { href: URL.createObjectURL(new Blob([text], { type })), download: name });
    document.body.append(a);
    a.click();
    a.remove();
  }

  // ------------------------------------------------------------------------------------------ code
  async function showCode(r) {
    const s = r.settings || r.asked;
    const payload = { input: s.input, voice: s.voice, mode: s.mode, instructions: s.instructions, seed: s.seed,
      speed: s.speed, language: s.language, lexicon: s.lexicon };
    try {
      state.code = await (await call("/lab/code", { method: "POST", json: payload })).json();
    } catch (err) {
      return notice(err.message, "error");
    }
    state.codeFor = r.label;
    $("lab-code").hidden = false;
    const notes = state.code.notes.map((n) => T["note_" + n] || n);
    notes.push(T.note_realtime);
    $("lab-code-notes").textContent = notes.join(" ");
    drawCode();
    $("lab-code").scrollIntoView({ block: "nearest" });
  }
  function drawCode() {
    $("lab-code-text").textContent = state.code ? state.code[state.codeTab] : "";
    document.querySelectorAll("#lab-code [data-code]").forEach((b) => b.classList.toggle("on", b.dataset.code === state.codeTab));
  }
  async function copy(text, button) {
    try { await navigator.clipboard.writeText(text); } catch (_) { /* no clipboard: the text stays selectable */ }
    const was = button.textContent;
    button.textContent = T.copied;
    setTimeout(() => { button.textContent = was; }, 1200);
  }

  // ------------------------------------------------------------------------------------------ promote
  function promote(r) {
    const s = r.settings || r.asked;
    const data = { text: s.input, voice: s.voice, mode: s.mode, instruct: s.mode === "instruct" ? s.instructions : "",
      seed: s.seed, speed: s.speed, language: s.language, lexicon: s.lexicon || "" };
    localStorage.setItem("cosystream-lab-promote", JSON.stringify(data));
    window.location.href = "/#lab=" + encode(data);
  }

  // ------------------------------------------------------------------------------------------ share
  function encode(obj) {
    const bytes = new TextEncoder().encode(JSON.stringify(obj));
    let bin = "";
    bytes.forEach((b) => { bin += String.fromCharCode(b); });
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }
  function decode(text) {
    const bin = atob(text.replace(/-/g, "+").replace(/_/g, "/"));
    return JSON.parse(new TextDecoder().decode(Uint8Array.from(bin, (c) => c.charCodeAt(0))));
  }
  function isPublicVoice(id) { const v = state.cfg.voices.find((x) => x.id === id); return !!(v && v.public); }
  function isPublicLexicon(id) { const x = state.cfg.lexicons.find((l) => l.id === id); return !!(x && x.public); }
  function share() {
    const b = base(), dropped = [];
    const voice = (id) => { if (!id) return ""; if (isPublicVoice(id)) return voiceName(id); dropped.push(voiceName(id)); return ""; };
    const data = { v: 1, text: b.input, language: b.language, mode: b.mode, instruct: b.instructions, seed: b.seed,
      speed: b.speed, voice: voice(b.voice), blind: $("lab-blind").checked,
      takes: state.rows.map((r) => ({ voice: voice(r.voice), instruct: r.instruct || "", seed: r.seed || "", speed: r.speed || "" })) };
    if (b.lexicon && isPublicLexicon(b.lexicon)) data.lexicon = b.lexicon;
    else if (b.lexicon) dropped.push(b.lexicon);
    const url = `${location.origin}/lab#s=${encode(data)}`;
    $("lab-share-box").hidden = false;
    $("lab-share-url").value = url;
    $("lab-share-note").textContent = dropped.length ? fmt("share_dropped", { items: [...new Set(dropped)].join(", ") }) : T.share_help;
    state.shareUrl = url;
    return url;
  }
  function byName(name, missing) {
    if (!name) return "";
    const v = state.cfg.voices.find((x) => x.public && (x.name === name || x.id === name));
    if (!v) missing.push(name);
    return v ? v.id : "";
  }
  function restore() {
    const m = location.hash.match(/[#&]s=([A-Za-z0-9_-]+)/);
    if (!m) return false;
    let data;
    try { data = decode(m[1]); } catch (_) { return false; }
    const missing = [];
    $("lab-text").value = String(data.text || "");
    $("lab-language").value = data.language || "auto";
    $("lab-mode").value = ["zero_shot", "cross_lingual", "instruct"].includes(data.mode) ? data.mode : "zero_shot";
    $("lab-instruct").value = String(data.instruct || "");
    $("lab-seed").value = data.seed ?? "";
    $("lab-speed").value = data.speed || 1;
    const voice = byName(data.voice, missing);
    if (voice) $("lab-voice").value = voice;
    if (data.lexicon && isPublicLexicon(data.lexicon)) $("lab-lexicon").value = data.lexicon;
    $("lab-blind").checked = !!data.blind;
    const takes = Array.isArray(data.takes) ? data.takes.slice(0, state.cfg.limits.max_takes) : [];
    if (takes.length >= 2) {
      state.rows = takes.map((t) => ({ voice: byName(t.voice, missing), instruct: String(t.instruct || ""), seed: String(t.seed ?? ""), speed: String(t.speed || "") }));
    }
    syncMode();
    notice(missing.length ? `${T.restored} ${fmt("restored_missing", { items: missing.join(", ") })}` : T.restored);
    return true;
  }

  // ------------------------------------------------------------------------------------------ lexicons
  function entries() {
    return $("lab-lex-entries").value.split("\n").map((line) => line.trim()).filter(Boolean).map((line) => {
      const matchCase = /\s!case$/.test(line);
      const clean = line.replace(/\s!case$/, "");
      const at = clean.indexOf("=");
      return { word: at < 0 ? clean : clean.slice(0, at).trim(), hint: at < 0 ? "" : clean.slice(at + 1).trim(), match_case: matchCase };
    });
  }
  async function saveLexicon() {
    const name = $("lab-lex-name").value.trim();
    const list = entries();
    const own = state.cfg.lexicons.find((x) => !x.public && x.name.toLowerCase() === name.toLowerCase());
    try {
      const path = own ? `/lab/lexicons/${own.id}` : "/lab/lexicons";
      const saved = await (await call(path, { method: own ? "PUT" : "POST", json: { name, entries: list } })).json();
      notice(fmt("lex_saved", { name: saved.name, n: saved.entries.length }));
      await loadConfig();
      $("lab-lexicon").value = saved.id;
    } catch (err) {
      notice(err.message, "error");
    }
  }
  async function tryLexicon() {
    const out = $("lab-lex-out");
    try {
      const got = await (await call("/lab/lexicons/apply", { method: "POST", json: { input: $("lab-text").value, entries: entries() } })).json();
      out.replaceChildren();
      if (!got.hits.length) return out.append(T.lex_no_hits);
      const text = $("lab-text").value;
      let pos = 0;
      for (const hit of got.hits) {
        out.append(text.slice(pos, hit.start), el("mark", { title: hit.say }, `${hit.matched} → ${hit.say}`));
        pos = hit.end;
      }
      out.append(text.slice(pos));
    } catch (err) {
      out.replaceChildren(el("span", { class: "lab-error" }, err.message));
    }
  }
  async function editLexicon(id) {
    const lex = await (await call(`/lab/lexicons/${id}`)).json();
    $("lab-lex-name").value = lex.name;
    $("lab-lex-entries").value = lex.entries.map((e) => `${e.word} = ${e.hint}${e.match_case ? " !case" : ""}`).join("\n");
  }
  function drawLexicons() {
    const select = $("lab-lexicon"), current = select.value;
    select.replaceChildren(el("option", { value: "" }, T.none));
    const list = $("lab-lex-list");
    list.replaceChildren();
    for (const x of state.cfg.lexicons) {
      select.append(el("option", { value: x.id }, `${x.name} (${x.entries})`));
      const item = el("li", {}, el("button", { type: "button", class: "lab-link", onclick: () => editLexicon(x.id) }, x.name),
        ` · ${x.entries} · ${x.public ? T.lex_public : T.lex_mine}`);
      if (!x.public) {
        item.append(" ", el("button", { type: "button", class: "lab-x", title: T.lex_delete, onclick: async () => {
          try { await call(`/lab/lexicons/${x.id}`, { method: "DELETE" }); await loadConfig(); } catch (err) { notice(err.message, "error"); }
        } }, "×"));
      }
      list.append(item);
    }
    select.value = [...select.options].some((o) => o.value === current) ? current : "";
  }

  // ------------------------------------------------------------------------------------------ batch
  async function startBatch() {
    const file = $("lab-batch-file").files[0];
    if (!file) return;
    const b = base();
    const settings = { voice: b.voice, mode: b.mode, instructions: b.instructions, seed: b.seed, speed: b.speed, language: b.language, lexicon: b.lexicon };
    const form = new FormData();
    form.append("file", file);
    form.append("settings", JSON.stringify(settings));
    const abort = new AbortController();
    const batch = (state.batch = { abort, done: 0, total: 0, errors: [], zip: null, finished: false });
    $("lab-batch-start").disabled = true;
    $("lab-batch-cancel").disabled = false;
    $("lab-batch-errors").replaceChildren();
    $("lab-batch-status").textContent = "";
    const progress = $("lab-batch-progress");
    progress.hidden = false;
    progress.value = 0;
    try {
      const response = await call("/lab/batch", { method: "POST", body: form, signal: abort.signal });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffered = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffered += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffered.indexOf("\n")) >= 0) {
          batchEvent(batch, JSON.parse(buffered.slice(0, cut)));
          buffered = buffered.slice(cut + 1);
        }
      }
    } catch (err) {
      $("lab-batch-status").textContent = abort.signal.aborted ? T.batch_cancelled : err.message;
    }
    batch.finished = true;
    $("lab-batch-start").disabled = false;
    $("lab-batch-cancel").disabled = true;
  }
  function batchEvent(batch, ev) {
    const progress = $("lab-batch-progress");
    const status = $("lab-batch-status");
    if (ev.type === "start") {
      batch.total = ev.total;
      progress.max = ev.total;
    } else if (ev.type === "line") {
      batch.done += 1;
      progress.value = batch.done;
      status.textContent = fmt("batch_progress", { done: batch.done, total: batch.total });
      if (ev.error) {
        batch.errors.push(ev);
        $("lab-batch-errors").append(el("li", {}, fmt("line_error", { line: ev.line, error: ev.error })));
      }
    } else if (ev.type === "done") {
      batch.zip = ev.zip;
      status.replaceChildren(fmt("batch_done", { ok: ev.rendered, failed: ev.failed }), " ",
        el("a", { href: ev.zip, download: "", id: "lab-batch-zip" }, T.batch_download));
    }
  }

  // ------------------------------------------------------------------------------------------ start
  function syncMode() {
    document.querySelector(".lab-instruct").hidden = $("lab-mode").value !== "instruct";
  }
  async function loadConfig() {
    state.cfg = await (await call("/lab/config")).json();
    drawLexicons();
  }

  async function start() {
    await loadConfig();
    const cfg = state.cfg;
    $("lab-model").textContent = [cfg.model, cfg.family, cfg.llm_variant && `LLM ${cfg.llm_variant}`].filter(Boolean).join(" · ");
    voiceOptions($("lab-voice"), false);
    const preset = $("lab-preset");
    preset.replaceChildren(el("option", { value: "" }, "—"), ...cfg.presets.map((p) => el("option", { value: p.instruct }, p.label)));
    preset.addEventListener("change", () => { if (preset.value) $("lab-instruct").value = preset.value; });
    $("lab-takes-help").textContent = fmt("takes_help", { n: cfg.limits.max_takes });
    state.rows = [0, 1, 2, 3].map((i) => ({ voice: "", instruct: "", seed: String(1000 + i), speed: "" }));
    if (!restore()) $("lab-text").value = $("lab").dataset.lang === "zh" ? "欢迎来到提示词实验室，这里可以并排比较不同的版本。" : "Welcome to the prompt lab, where takes are compared side by side.";
    drawRows();
    syncMode();
    $("lab-mode").addEventListener("change", syncMode);
    $("lab-add").addEventListener("click", () => {
      if (state.rows.length < cfg.limits.max_takes) { state.rows.push({ voice: "", instruct: "", seed: String(Math.floor(Math.random() * 1e6)), speed: "" }); drawRows(); }
    });
    $("lab-vary").addEventListener("click", () => { state.rows.forEach((r) => { r.seed = String(Math.floor(Math.random() * 1e6)); }); drawRows(); });
    $("lab-generate").addEventListener("click", generate);
    $("lab-play-all").addEventListener("click", playAll);
    $("lab-reveal").addEventListener("click", reveal);
    $("lab-export-csv").addEventListener("click", () => download("cosystream-takes.csv", csv(rows()), "text/csv"));
    $("lab-export-json").addEventListener("click", () => download("cosystream-takes.json", JSON.stringify(rows(), null, 1), "application/json"));
    $("lab-share").addEventListener("click", share);
    $("lab-share-copy").addEventListener("click", (e) => copy($("lab-share-url").value, e.target));
    document.querySelectorAll("#lab-code [data-code]").forEach((b) => b.addEventListener("click", () => { state.codeTab = b.dataset.code; drawCode(); }));
    $("lab-code-copy").addEventListener("click", (e) => copy($("lab-code-text").textContent, e.target));
    $("lab-lex-save").addEventListener("click", saveLexicon);
    $("lab-lex-try").addEventListener("click", tryLexicon);
    $("lab-batch-start").addEventListener("click", startBatch);
    $("lab-batch-cancel").addEventListener("click", () => state.batch && state.batch.abort.abort());
    const lang = $("lab-lang");
    lang.href = `?lang=${new URLSearchParams(lang.getAttribute("href").slice(1)).get("lang")}${location.hash}`;
    state.ready = true;
    document.body.dataset.ready = "1";
  }
  start().catch((err) => notice(err.message, "error"));
})();
