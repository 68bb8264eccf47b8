// Error toasts in the page's language. Gradio 6.17 titles every error toast "Error": its client reads the
// title from a misspelt field (`_title`), so the title the server sends with the error never shows. This
// puts the header's translated title (data-error-title) in place as soon as a toast appears.
(() => {
  "use strict";
  function retitle() {
    const header = document.querySelector("[data-error-title]");
    if (!header) return;
    for (const el of document.querySelectorAll(".toast-title.error")) {
      for (const node of el.childNodes) {
        if (node.nodeType === Node.TEXT_NODE && node.nodeValue.trim() === "Error") {
          node.nodeValue = header.dataset.errorTitle + " ";
        }
      }
    }
  }
  new MutationObserver(retitle).observe(document.documentElement, { childList: true, subtree: true });
})();
