// The studio by keyboard and screen reader: what Gradio 6.17's components do not do themselves.
// - The mode radios are one group: Gradio gives each radio input its own name ("radio-11", "radio-12", ...),
//   which makes five Tab stops and no arrow keys; one shared name makes them the browser's own radio group
//   (its arrow keys are handled here: Chromium's own skipped a mode), and a roving tabindex leaves one
//   Tab stop, the picked mode. Re-applied whenever Gradio re-renders the choices.
// - Ctrl+Enter (Cmd+Enter on a Mac) presses Generate, or "Perform the script" inside the script desk.
// - On a Chinese page, the English aria-labels and titles Gradio hard-codes in its audio, slider, number
//   and footer components are put in Chinese (those Gradio translates itself are left alone).
(() => {
  "use strict";
  const GROUP = "cosy-mode";

  function oneGroup(root) {
    const fieldset = root.querySelector ? root.querySelector("#cosy-mode") : null;
    if (!fieldset) return;
    const wrap = fieldset.querySelector(".wrap");
    if (wrap && wrap.getAttribute("role") !== "radiogroup") {
      wrap.setAttribute("role", "radiogroup");
      const label = fieldset.querySelector('[data-testid="block-info"]');
      if (label) wrap.setAttribute("aria-label", label.textContent.trim());
    }
    const inputs = [...fieldset.querySelectorAll('input[type="radio"]')];
    const picked = inputs.find((input) => input.checked) || inputs[0];
    for (const input of inputs) {
      if (input.name !== GROUP) input.name = GROUP;
      // one Tab stop, the picked mode (Chromium still stopped at every radio of the shared name)
      const tab = input === picked ? "0" : "-1";
      if (input.getAttribute("tabindex") !== tab) input.setAttribute("tabindex", tab);
    }
  }

  const STEPS = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 };

  function moveMode(event) {
    // the arrows in the mode group, by hand: Chromium's own walk over the shared name skipped the first
    // mode going left; Home / End go to the first / last (WAI-ARIA radio group)
    const input = event.target;
    if (!(input instanceof HTMLInputElement) || !input.closest("#cosy-mode")) return;
    const inputs = [...input.closest("#cosy-mode").querySelectorAll('input[type="radio"]')];
    const at = inputs.indexOf(input);
    let to = null;
    if (event.key in STEPS) to = (at + STEPS[event.key] + inputs.length) % inputs.length;
    if (event.key === "Home") to = 0;
    if (event.key === "End") to = inputs.length - 1;
    if (to === null || event.altKey || event.ctrlKey || event.metaKey) return;
    event.preventDefault();
    inputs[to].focus();
    inputs[to].click(); // checks it and fires the events Gradio listens to
  }

  function pressGenerate(event) {
    if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey) || event.altKey || event.shiftKey) return;
    const inScript = event.target instanceof Element && event.target.closest("#cosy-script");
    const button = document.getElementById(inScript ? "cosy-script-go" : "cosy-generate");
    if (!button || button.disabled) return;
    event.preventDefault();
    button.click();
  }

  // Gradio's own English words -> Chinese; "{x}" is the label it names (already in the page's language)
  const ZH = {
    "File upload": "上传文件", "Upload file": "上传文件", "Record audio": "录音", "Clear": "清除",
    "Download": "下载", "Share": "分享", "Play": "播放", "Pause": "暂停", "Empty value": "空",
    "Reset to default value": "恢复默认值", "Gradio footer navigation": "页脚导航", "Close": "关闭",
    "Skip backward": "后退", "Skip forward": "前进", "Mute": "静音", "Unmute": "取消静音",
    "Volume": "音量", "Trim audio to selection": "裁剪到所选片段", "Undo": "撤销", "Edit": "编辑",
    "Reset audio": "重置音频", "Adjust playback speed": "调整播放速度", "Stop recording": "停止录音",
    "Start recording": "开始录音", "Record": "录音", "Copy": "复制", "Copied": "已复制",
    "Remove": "移除", "Select input device": "选择输入设备", "Loading": "加载中", "Fullscreen": "全屏",
    "Error": "错误", "Info": "提示", "Warning": "警告", "Success": "成功",
    "number input for {x}": "{x}：数值", "range slider for {x}": "{x}：滑块",
    "Adjust playback speed to {x}": "播放速度 {x}", "Play {x}": "播放 {x}", "Adjust volume": "调节音量",
    "undo": "撤销", "Skip backwards by {n} seconds": "后退 {n} 秒", "Skip forward by {n} seconds": "前进 {n} 秒",
  };
  // "{n}": a number Gradio prints unrounded ("0.31586249999999993 seconds"), shown to two decimals at most
  const PATTERNS = Object.entries(ZH)
    .filter(([en]) => /\{[xn]\}/.test(en))
    .map(([en, zh]) => [new RegExp("^" + en.replace("{x}", "(.+)").replace("{n}", "([0-9.]+)") + "$"), zh]);
  const ATTRS = ["aria-label", "title"];

  function inChinese(text) {
    const t = text.trim();
    if (ZH[t] !== undefined) return ZH[t];
    for (const [re, zh] of PATTERNS) {
      const m = t.match(re);
      if (m) return zh.replace("{x}", m[1]).replace("{n}", String(Math.round(Number(m[1]) * 100) / 100));
    }
    return null;
  }

  function translate(root) {
    if (!root.querySelectorAll) return;
    const nodes = [root, ...root.querySelectorAll("[aria-label], [title]")];
    for (const node of nodes) {
      for (const attr of ATTRS) {
        const value = node.getAttribute && node.getAttribute(attr);
        const zh = value && inChinese(value);
        if (zh && zh !== value) node.setAttribute(attr, zh);
      }
    }
  }

  function pageLang() {
    // the header says which language the server rendered the page in (views.header_html)
    const header = document.querySelector(".cosy-header[data-lang]");
    return header ? header.dataset.lang : (document.documentElement.lang || "").slice(0, 2);
  }

  function mend(root) {
    oneGroup(document);
    if (pageLang() === "zh") translate(root);
  }

  let queued = false;
  const observer = new MutationObserver((records) => {
    if (queued) return;
    queued = true;
    // once per frame: Gradio renders in bursts
    requestAnimationFrame(() => {
      queued = false;
      mend(document.body);
    });
  });

  function begin() {
    mend(document.body);
    const attributes = { attributes: true, attributeFilter: ATTRS };
    observer.observe(document.body, { childList: true, subtree: true, ...attributes });
  }

  document.addEventListener("keydown", pressGenerate, true);
  document.addEventListener("keydown", moveMode, true);
  document.addEventListener("change", (e) => {
    if (e.target instanceof Element && e.target.closest("#cosy-mode")) oneGroup(document);
  }, true);
  if (document.body) begin();
  else document.addEventListener("DOMContentLoaded", begin, { once: true });
})();
