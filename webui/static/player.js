// CosyStream live player: plays a request's PCM with WebAudio while it is generated.
//
// Gradio's streamed gr.Audio buffers seconds before it plays, so the Generate button's js hook draws the
// request id, calls cosyPlayer.start(rid) (which announces it with POST webui/pcm/<rid>) and passes the id to
// the handler; the handler publishes every chunk to GET webui/pcm/<rid> (raw little-endian int16 mono, rate in X-Sample-Rate). Buffers are scheduled
// back to back on one AudioContext; "first sound" is the moment the first audible sample reaches the
// output, measured from the click with performance.now() (AudioContext.getOutputTimestamp maps the
// context clock to it). window.cosyPlayer.stats exposes the numbers (the browser test reads them).
(() => {
  "use strict";
  const PREBUFFER_S = 0.06; // gathered before the first buffer starts: absorbs network jitter
  const LEAD_S = 0.01; // scheduling margin ahead of the output clock
  const AUDIBLE = 1e-3; // |sample| above this counts as sound (-60 dBFS)
  const PEAK_BINS = 180; // bars in the live waveform

  const S = { rid: "", fileRid: "", ctx: null, ctrl: null, nextAt: 0, pending: [], pendingN: 0, sources: [], peaks: [], top: 0 };
  // the take's PCM as received (int16 LE, the wire format): what the browser keeps of a take the server
  // could not finish or can no longer serve (keep.js); {rid, rate, parts: Uint8Array[]}
  let take = { rid: "", rate: 0, parts: [] };
  let stats = fresh("");

  function fresh(rid) {
    return {
      rid, state: "idle", clickAt: performance.now(), sampleRate: 0, bytes: 0, samples: 0, reads: 0,
      scheduledS: 0, playedS: 0, underruns: 0, error: null,
      firstByteMs: null, // click -> first PCM bytes read (server + network side)
      firstPlayMs: null, // click -> first sample reaches the output, audible or not
      firstSoundMs: null, // click -> first sample above -60 dBFS reaches the output
    };
  }

  function newRid() {
    const b = crypto.getRandomValues(new Uint8Array(16)); // works outside secure contexts too
    return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  }

  function context() {
    if (!S.ctx) S.ctx = new (window.AudioContext || window.webkitAudioContext)({ latencyHint: "interactive" });
    if (S.ctx.state === "suspended") S.ctx.resume(); // allowed: we are inside the click's handler
    return S.ctx;
  }

  function toPerf(ctx, when) {
    // performance.now() time at which context time `when` is heard: never before now, since the output
    // timestamp it projects from is a moment past and can put a sample scheduled now a hair in the past.
    const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    const now = performance.now();
    if (ts && ts.performanceTime > 0) return Math.max(now, ts.performanceTime + (when - ts.contextTime) * 1000);
    return now + (when - ctx.currentTime + (ctx.outputLatency || ctx.baseLatency || 0)) * 1000;
  }

  function setBrowserTtfa(text) {
    // The metrics card is re-rendered by the server on every chunk; a CSS variable survives that.
    document.documentElement.style.setProperty("--cosy-bttfa", JSON.stringify(text));
  }

  function resetMetrics() {
    // The last take's tiles go at the click: the server writes this take's at its first chunk.
    for (const el of document.querySelectorAll(".cosy-metrics [data-metric]")) el.textContent = "—";
    for (const el of document.querySelectorAll(".cosy-metrics .cosy-seg")) el.style.width = "0";
    if (kept) { URL.revokeObjectURL(kept.url); kept = null; }
    const box = document.querySelector("#cosy-live .cosy-kept");
    if (box) box.remove();
  }

  function setStatus(state, text) {
    // The status line as the page itself words it (the server's next update replaces it)
    const status = document.querySelector(".cosy-status");
    if (!status || !text) return;
    status.dataset.state = state;
    status.textContent = text;
  }

  function liveText(key) {
    const live = document.getElementById("cosy-live");
    return live ? live.dataset[key] : "";
  }

  function awaitServer() {
    // At the click the last take's "Done" goes: until the server's first word the line says it waits
    // (and, should no word come, finished() or link.js says the take failed)
    setStatus("waiting", liveText("textWaiting"));
  }

  function start(rid) {
    stop();
    resetMetrics();
    awaitServer();
    take = { rid, rate: 0, parts: [] };
    const ctx = context();
    S.rid = rid; S.nextAt = 0; S.pending = []; S.pendingN = 0; S.sources = []; S.peaks = []; S.top = 0;
    stats = fresh(rid);
    stats.state = "waiting";
    setBrowserTtfa("…");
    render();
    const ctrl = (S.ctrl = new AbortController());
    const url = new URL("webui/pcm/" + rid, document.baseURI);
    // announce the id first: the server refuses a read of an id nobody announced at once (404)
    fetch(url, { method: "POST", signal: ctrl.signal })
      .then((said) => (said.ok ? fetch(url, { signal: ctrl.signal, cache: "no-store" }) : said))
      .then((resp) => pump(resp, rid, ctx))
      .catch((err) => {
        if (err.name === "AbortError" || S.rid !== rid) return;
        stats.state = "error"; stats.error = String(err); render();
      });
  }

  function idle(rid) {
    // Streaming is off: remember the id (Stop needs it), show no live numbers, and wake the output inside
    // the click, so the finished file may play when the request ends (finished()).
    stop();
    resetMetrics();
    take = { rid, rate: 0, parts: [] };
    context();
    awaitServer();
    S.rid = rid; S.fileRid = rid; stats = fresh(rid); stats.state = "waiting";
    setBrowserTtfa("—");
    render();
  }

  async function finished() {
    // Generate's event ended. A failed request marks the card; with streaming off, the whole file plays on the context the click woke (a
    // media element told to autoplay from a later update may be refused by the browser, and Gradio's
    // waveform player does not play it); a failed request has no file (404) and plays nothing.
    const rid = S.fileRid;
    S.fileRid = "";
    if (document.querySelector('.cosy-status[data-state="waiting"]')) {
      // the event ended with no word from the server (it could not be reached): a failure, said so
      setStatus("failed", liveText(take.parts.length ? "textLost" : "textNoAnswer"));
    }
    if (document.querySelector('.cosy-status[data-state="failed"]')) {
      if (S.rid) { stats.state = "error"; render(); } // what was received played; the card says it failed
      return;
    }
    if (document.querySelector('.cosy-status[data-state="refused"]')) {
      if (S.rid) { stats.state = "idle"; render(); } // its input stopped it: nothing was made or played
      return;
    }
    if (!rid || S.rid !== rid) return;
    const resp = await fetch(new URL("webui/audio/" + rid + ".wav", document.baseURI), { cache: "no-store" });
    if (resp.status !== 200 || S.rid !== rid) { if (S.rid === rid) { stats.state = "idle"; render(); } return; }
    const ctx = context();
    const buf = await ctx.decodeAudioData(await resp.arrayBuffer());
    if (S.rid !== rid) return;
    const pcm = buf.getChannelData(0);
    stats.sampleRate = buf.sampleRate; stats.samples = pcm.length; stats.state = "playing";
    S.peaks = []; S.top = 0; addPeaks(pcm);
    const src = ctx.createBufferSource();
    src.buffer = buf;
    src.connect(ctx.destination);
    src.onended = () => { if (S.sources.includes(src)) { stats.playedS = buf.duration; stats.state = "done"; render(); } };
    src.start();
    S.sources.push(src);
    stats.scheduledS = buf.duration;
    render();
  }

  async function pump(resp, rid, ctx) {
    if (resp.status !== 200) { stats.state = "idle"; setBrowserTtfa("—"); render(); return; }
    stats.sampleRate = Number(resp.headers.get("X-Sample-Rate"));
    if (take.rid === rid) take.rate = stats.sampleRate;
    stats.state = "streaming";
    const reader = resp.body.getReader();
    let carry = null; // a read may end inside a 2-byte sample
    for (;;) {
      const { done, value } = await reader.read();
      if (done || S.rid !== rid) break;
      let bytes = value;
      if (carry) { bytes = new Uint8Array(carry.length + value.length); bytes.set(carry); bytes.set(value, carry.length); }
      const n = bytes.length >> 1;
      carry = bytes.length & 1 ? bytes.slice(-1) : null;
      if (take.rid === rid) take.parts.push(bytes.slice(0, n * 2));
      const view = new DataView(bytes.buffer, bytes.byteOffset, n * 2);
      const pcm = new Float32Array(n);
      for (let i = 0; i < n; i++) pcm[i] = view.getInt16(2 * i, true) / 32768;
      if (stats.firstByteMs === null) stats.firstByteMs = performance.now() - stats.clickAt;
      stats.bytes += value.length; stats.samples += n; stats.reads += 1;
      feed(pcm, ctx, false);
      addPeaks(pcm);
      render();
    }
    if (S.rid !== rid) return;
    feed(new Float32Array(0), ctx, true);
    if (stats.state === "streaming") stats.state = "playing";
    const left = Math.max(0, S.nextAt - ctx.currentTime);
    setTimeout(() => { if (S.rid === rid && stats.state === "playing") { stats.state = "done"; render(); } }, left * 1000);
    if (stats.firstSoundMs === null) setBrowserTtfa("—");
    render();
  }

  function feed(pcm, ctx, final) {
    if (pcm.length) { S.pending.push(pcm); S.pendingN += pcm.length; }
    const waiting = S.nextAt === 0 && S.pendingN < PREBUFFER_S * stats.sampleRate;
    if (!S.pendingN || (waiting && !final)) return;
    const all = new Float32Array(S.pendingN);
    let off = 0;
    for (const p of S.pending) { all.set(p, off); off += p.length; }
    S.pending = []; S.pendingN = 0;
    schedule(all, ctx);
  }

  function schedule(pcm, ctx) {
    const sr = stats.sampleRate;
    const buf = ctx.createBuffer(1, pcm.length, sr);
    buf.copyToChannel(pcm, 0);
    const src = ctx.createBufferSource();
    src.buffer = buf;
    src.connect(ctx.destination);
    let at = S.nextAt;
    const earliest = ctx.currentTime + LEAD_S;
    if (at < earliest) { if (at > 0) stats.underruns += 1; at = earliest; }
    src.onended = () => { if (S.sources.includes(src)) { stats.playedS += buf.duration; render(); } };
    src.start(at);
    S.sources.push(src);
    S.nextAt = at + buf.duration;
    stats.scheduledS += buf.duration;
    if (stats.firstPlayMs === null) stats.firstPlayMs = toPerf(ctx, at) - stats.clickAt;
    if (stats.firstSoundMs === null) markFirstSound(pcm, ctx, at, sr);
  }

  function markFirstSound(pcm, ctx, at, sr) {
    const i = pcm.findIndex((x) => Math.abs(x) > AUDIBLE);
    if (i < 0) return;
    const heardAt = toPerf(ctx, at + i / sr);
    stats.firstSoundMs = heardAt - stats.clickAt;
    const rid = S.rid;
    setTimeout(() => {
      if (S.rid !== rid) return;
      setBrowserTtfa(Math.round(stats.firstSoundMs) + " ms");
      render();
    }, Math.max(0, heardAt - performance.now()));
  }

  function stop() {
    S.fileRid = ""; // a stopped request's partial file is not played
    if (S.ctrl) S.ctrl.abort();
    S.ctrl = null;
    const sources = S.sources;
    S.sources = [];
    for (const src of sources) { try { src.stop(); } catch (e) { /* never started */ } }
    if (stats.state === "waiting" || stats.state === "streaming" || stats.state === "playing") stats.state = "stopped";
    render();
  }

  function wav(rid) {
    // The take's received PCM as a 16-bit mono wav (44-byte RIFF header), or null if none was received.
    if (!rid || take.rid !== rid || !take.rate) return null;
    const size = take.parts.reduce((n, p) => n + p.length, 0);
    if (!size) return null;
    const head = new DataView(new ArrayBuffer(44));
    const text = (at, word) => { for (let i = 0; i < 4; i++) head.setUint8(at + i, word.charCodeAt(i)); };
    text(0, "RIFF"); head.setUint32(4, 36 + size, true); text(8, "WAVE"); text(12, "fmt ");
    head.setUint32(16, 16, true); head.setUint16(20, 1, true); head.setUint16(22, 1, true);
    head.setUint32(24, take.rate, true); head.setUint32(28, take.rate * 2, true);
    head.setUint16(32, 2, true); head.setUint16(34, 16, true); text(36, "data"); head.setUint32(40, size, true);
    return new Blob([head.buffer, ...take.parts], { type: "audio/wav" });
  }

  let kept = null; // {url, seconds, name}: the take shown as kept, until the next take starts

  function showKept(blob, seconds, name) {
    // Play and download what the browser kept of a take the server cannot serve now.
    if (!blob) return;
    if (kept) URL.revokeObjectURL(kept.url);
    kept = { url: URL.createObjectURL(blob), seconds, name };
    drawKept();
  }

  function drawKept() {
    // The server re-renders the live card (on load, in the page's language): the kept take goes back in.
    const root = document.getElementById("cosy-live");
    if (!root || !kept || root.querySelector(".cosy-kept")) return;
    const box = document.createElement("div");
    box.className = "cosy-kept";
    root.append(box);
    const { url, seconds, name } = kept;
    const label = (root.dataset.textKept || "{audio} s").replace("{audio}", seconds.toFixed(1));
    const note = document.createElement("span");
    note.textContent = label;
    const player = document.createElement("audio");
    player.controls = true; player.src = url; player.preload = "auto";
    const link = document.createElement("a");
    link.href = url; link.download = name; link.textContent = root.dataset.textDownload || "wav";
    box.append(note, player, link);
  }

  function addPeaks(pcm) {
    const step = Math.max(1, Math.round(stats.sampleRate * 0.02)); // one bar per 20 ms
    for (let i = 0; i < pcm.length; i += step) {
      let peak = 0;
      for (let j = i; j < Math.min(i + step, pcm.length); j++) peak = Math.max(peak, Math.abs(pcm[j]));
      S.peaks.push(peak);
      S.top = Math.max(S.top || 0, peak);
    }
    if (S.peaks.length > PEAK_BINS) S.peaks = S.peaks.slice(-PEAK_BINS);
  }

  function render() {
    const root = document.getElementById("cosy-live");
    if (!root) return;
    root.dataset.state = stats.state;
    const set = (key, text) => { const el = root.querySelector(`[data-live="${key}"]`); if (el) el.textContent = text; };
    set("state", root.dataset["label" + stats.state[0].toUpperCase() + stats.state.slice(1)] || stats.state);
    set("first", stats.firstSoundMs === null ? "—" : Math.round(stats.firstSoundMs) + " ms");
    set("received", stats.sampleRate ? (stats.samples / stats.sampleRate).toFixed(1) + " s" : "—");
    set("underruns", String(stats.underruns));
    drawWave(root.querySelector("canvas"));
  }

  function drawWave(canvas) {
    if (!canvas) return;
    const w = (canvas.width = canvas.clientWidth * devicePixelRatio);
    const h = (canvas.height = canvas.clientHeight * devicePixelRatio);
    const g = canvas.getContext("2d");
    g.clearRect(0, 0, w, h);
    g.fillStyle = getComputedStyle(canvas).color;
    const bw = w / PEAK_BINS;
    S.peaks.forEach((p, i) => {
      const bh = Math.max(1, (p / Math.max(S.top || 0, 0.01)) * h * 0.9); // auto-gain, floor at -40 dBFS
      g.fillRect(i * bw, (h - bh) / 2, Math.max(1, bw - 1), bh);
    });
  }

  // The transcript field holds the visitor's own words for the next prompt while they have typed (or
  // pasted) some with no prompt given: every edit of theirs fires a DOM input event, a value set by the
  // server or an example does not. Words written while a prompt is there are that prompt's: a prompt that
  // replaces it is transcribed afresh. Transcription and clearing the prompt read the flag (player.py,
  // TRANSCRIBE_JS / CLEARED_JS); the prompt's change hook keeps window.cosyPrompt (layout.py).
  document.addEventListener("input", (e) => {
    if (e.target instanceof HTMLTextAreaElement && e.target.closest("#cosy-transcript")) {
      window.cosyTyped = e.target.value.trim() !== "" && !window.cosyPrompt;
    }
  }, { capture: true });

  // Start the audio output at the page's first gesture, so Generate does not pay for the device spin-up.
  document.addEventListener("pointerdown", () => context(), { once: true, capture: true });

  new MutationObserver(drawKept).observe(document.documentElement, { childList: true, subtree: true });

  // Gradio's result player aborts the load of a result a newer one replaces: its play() promise then
  // rejects with an AbortError nobody awaits (three uncaught errors per replaced result). A superseded
  // load is no failure: those rejections are handled here; every other error still surfaces.
  window.addEventListener("unhandledrejection", (e) => {
    if (e.reason && e.reason.name === "AbortError") e.preventDefault();
  });

  window.cosyPlayer = {
    newRid, start, idle, finished, stop, wav, showKept,
    get take() { return { rid: take.rid, rate: take.rate, bytes: take.parts.reduce((n, p) => n + p.length, 0) }; },
    get rid() { return S.rid; },
    get stats() { return { ...stats }; },
  };
})();
