/* attnlab attention explorer: the colour map (viridis), the legend that states its scale, the box
   that shows a value under the mouse, SVG elements and their rasterising to PNG. Defined before
   explorer.js, which uses them. */
window.attnlabDraw = (function () {
  "use strict";
  const SVGNS = "http://www.w3.org/2000/svg";
  // viridis, sampled at 0, .25, .5, .75, 1
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

  function colormap(x) {
    const f = Math.min(Math.max(x, 0), 1) * (STOPS.length - 1), i = Math.min(Math.floor(f), STOPS.length - 2);
    const a = STOPS[i], b = STOPS[i + 1], t = f - i;
    return [a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t];
  }

  // a gradient from 0 to ``top`` with three labelled ticks; values above ``top`` take its colour
  function legend(canvas, top, label) {
    const w = 180, h = 10, ctx = canvas.getContext("2d");
    canvas.hidden = false; canvas.width = w + 130; canvas.height = 30;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let x = 0; x < w; x++) {
      const rgb = colormap(x / (w - 1));
      ctx.fillStyle = `rgb(${rgb[0] | 0},${rgb[1] | 0},${rgb[2] | 0})`; ctx.fillRect(x, 4, 1, h);
    }
    ctx.fillStyle = "#222"; ctx.font = "10px sans-serif"; ctx.textAlign = "center";
    for (const f of [0, 0.5, 1])
      ctx.fillText((f === 1 ? "≥" : "") + (f * top).toPrecision(2), Math.min(Math.max(f * (w - 1), 8), w - 12), 26);
    ctx.textAlign = "left"; ctx.fillText(label, w + 6, 13);
    canvas.dataset.top = top;
  }

  // ``text`` in a small box beside the mouse; null hides it
  function tip(box, e, text) {
    if (text === null) { box.hidden = true; return; }
    box.textContent = text; box.hidden = false;
    box.style.left = (e.pageX + 12) + "px"; box.style.top = (e.pageY + 12) + "px";
  }

  function svgEl(name, attrs, parent) {
    const e = document.createElementNS(SVGNS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function svgText(svg) {
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(svg);
  }

  function svgDataUrl(text) {
    return "data:image/svg+xml;base64," + btoa(unescape(encodeURIComponent(text)));
  }

  // an SVG drawn on screen (the head and neuron views) rasterised at ``s`` times its size: a
  // vector drawing, so the PNG is sharp at any resolution; resolves to {png, svg} data URLs
  function rasterise(svg, s) {
    const url = svgDataUrl(svgText(svg));
    return new Promise((resolve, reject) => {
      const img = new Image();
      img.onload = () => {
        const c = document.createElement("canvas");
        c.width = Math.round(img.width * s); c.height = Math.round(img.height * s);
        c.getContext("2d").drawImage(img, 0, 0, c.width, c.height);
        resolve({ png: c.toDataURL("image/png"), svg: url });
      };
      img.onerror = () => reject(new Error("the drawing could not be rasterised"));
      img.src = url;
    });
  }

  return { colormap, legend, tip, svgEl, svgText, svgDataUrl, rasterise };
})();
