// Typesets the formulas that pymdownx.arithmatex leaves in the page: \( ... \) inline and
// \[ ... \] in display blocks, each inside an element of class "arithmatex". KaTeX itself is
// copied into the site by docs/_hooks/offline.py, so nothing is fetched.
document.addEventListener("DOMContentLoaded", function () {
  var delimiters = [{left: "\\[", right: "\\]", display: true}, {left: "\\(", right: "\\)", display: false}];
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    // throwOnError false: a formula KaTeX cannot parse is shown in red (class katex-error),
    // which tests/test_site_browser.py looks for, instead of stopping the other formulas
    renderMathInElement(element, {delimiters: delimiters, throwOnError: false});
  });
  document.documentElement.dataset.mathTypeset = document.querySelectorAll(".arithmatex .katex").length;
});
