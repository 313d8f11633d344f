// Copy buttons: <button data-copy="ID" data-copied="Copied"> copies the text of the element #ID.
// The buttons are hidden until this script runs, since without it they could do nothing.
// Where the clipboard is not available (a page served over plain HTTP), the text is selected
// instead, so Ctrl+C / Cmd+C copies it.
(function () {
  "use strict";

  function select(element) {
    const range = document.createRange();
    range.selectNodeContents(element);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function copied(button) {
    const label = button.dataset.copied;
    if (!label) {
      return;
    }
    const before = button.textContent;
    button.textContent = label;
    window.setTimeout(function () { button.textContent = before; }, 1500);
  }

  function show() {
    document.querySelectorAll("button[data-copy]").forEach(function (button) {
      button.classList.remove("hidden");
    });
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-copy]");
    if (!button) {
      return;
    }
    const source = document.getElementById(button.dataset.copy);
    if (!source) {
      return;
    }
    const text = source.textContent;
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { copied(button); }, function () { select(source); });
    } else {
      select(source);
    }
  });

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", show);
  } else {
    show();
  }
})();
