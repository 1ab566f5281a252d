/* attnlab attention explorer: the neuron view. For one layer, one head (the first shown) and one
   query token it draws the query vector q, every key vector k, their elementwise products q*k,
   the score (the products' sum times the view's scale, 1/sqrt(D) by default) and the weight the
   softmax made of it: where a weight comes from, channel by channel. It needs the view's
   "neurons" (queries and keys, float32; see attnlab/viz/explorer/__init__.py). Defined before
   explorer.js, which calls it with what it shares. */
window.attnlabNeuronView = function (api) {
  "use strict";
  const { state, view, $, svgEl, rowVector, layerData, SVGNS } = api;
  const cache = new Map();
  const MAX_KEYS = 48;              // more keys than this: the strongest, in key order

  function floats(b64) {
    const text = atob(b64), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return new Float32Array(bytes.buffer);
  }

  function vectors(v, l) {
    const key = v.name + "#" + l;
    if (!cache.has(key)) cache.set(key, { q: floats(v.neurons.q[l]), k: floats(v.neurons.k[l]) });
    return cache.get(key);
  }

  // blue for negative, white for 0, red for positive, clipped at +-limit
  function diverging(x, limit) {
    const f = Math.max(-1, Math.min(1, limit > 0 ? x / limit : 0));
    const [r, g, b] = f >= 0 ? [255, 255 - 200 * f, 255 - 200 * f] : [255 + 200 * f, 255 + 200 * f, 255];
    return `rgb(${r | 0},${g | 0},${b | 0})`;
  }

  function draw() {
    const v = view(), n = v.neurons, D = n.dim, T = v.rows.length, S = v.cols.length;
    const h = Math.min(...state.heads), l = state.layer;
    const t = Math.min(state.token, T - 1);
    const { q, k } = vectors(v, l);
    const qt = q.subarray((h * T + t) * D, (h * T + t + 1) * D);
    const weights = rowVector(layerData(v, l), h, t);
    let keys = Array.from({ length: S }, (_, s) => s);
    if (S > MAX_KEYS) keys = keys.sort((a, b) => weights[b] - weights[a]).slice(0, MAX_KEYS).sort((a, b) => a - b);
    const kv = (s) => k.subarray((h * S + s) * D, (h * S + s + 1) * D);
    let vmax = 0, pmax = 0;
    for (const x of qt) vmax = Math.max(vmax, Math.abs(x));
    for (const s of keys) { const ks = kv(s); for (let i = 0; i < D; i++) { vmax = Math.max(vmax, Math.abs(ks[i])); pmax = Math.max(pmax, Math.abs(qt[i] * ks[i])); } }
    const cell = Math.max(3, Math.min(14, Math.floor(300 / D))), rowH = 16, lw = 110, gap = 28;
    const col = Math.max(D * cell, 170), xk = 10 + lw, xp = xk + col + gap, xs = xp + col + gap;
    const top = 70, width = xs + 230, height = top + (keys.length + 2) * rowH + 40;
    const svg = svgEl("svg", { xmlns: SVGNS, width, height, viewBox: `0 0 ${width} ${height}`, id: "neuron-svg" });
    svgEl("rect", { x: 0, y: 0, width, height, fill: "#fff" }, svg);
    const text = (x, y, s, attrs) => { const e = svgEl("text", Object.assign({ x, y, fill: "#222", "font-size": 11 }, attrs || {}), svg); e.textContent = s; return e; };
    text(4, 14, `${v.title}, layer ${l + 1}, head ${h + 1} (the first head shown), query "${v.rows[t]}"`, { "font-size": 12 });
    text(4, 30, `score = (q · k) × ${n.scale.toPrecision(3)};  weight = softmax of the scores over the allowed keys`, { fill: "#555" });
    text(xk, top - 14, "q (top row) and each k"); text(xp, top - 14, "q × k, channel by channel");
    text(xs, top - 14, "score"); text(xs + 60, top - 14, "weight");
    const strip = (x, y, values, limit, cls, index) => {
      for (let i = 0; i < D; i++)
        svgEl("rect", { x: x + i * cell, y: y - 10, width: cell, height: 12, fill: diverging(values[i], limit), class: cls,
                        "data-index": index, "data-channel": i, "data-value": values[i].toPrecision(4) }, svg);
    };
    // the query row, then one row per key
    text(xk - 6, top + 2, "q: " + v.rows[t].slice(0, 14), { "text-anchor": "end", "font-weight": "bold" });
    strip(xk, top + 2, qt, vmax, "q", t);
    keys.forEach((s, r) => {
      const y = top + (r + 1.5) * rowH, ks = kv(s), prod = new Float32Array(D);
      let dot = 0;
      for (let i = 0; i < D; i++) { prod[i] = qt[i] * ks[i]; dot += prod[i]; }
      text(xk - 6, y, v.cols[s].slice(0, 16), { "text-anchor": "end", class: "key-label", "data-index": s });
      strip(xk, y, ks, vmax, "k", s);
      strip(xp, y, prod, pmax, "qk", s);
      const w = weights[s] * v.scale;
      text(xs, y, (dot * n.scale).toFixed(3), { class: "score", "data-index": s, "font-family": "monospace" });
      svgEl("rect", { x: xs + 60, y: y - 9, width: Math.max(0.5, 110 * w), height: 10, fill: api.color(h), class: "weight-bar" }, svg);
      text(xs + 60 + 110 * w + 4, y, w.toFixed(3), { class: "weight", "data-index": s, "font-family": "monospace" });
    });
    // the two colour scales
    const ly = height - 18;
    [[xk, vmax, "q, k"], [xp, pmax, "q × k"]].forEach(([x, limit, label]) => {
      for (let i = 0; i <= 40; i++) svgEl("rect", { x: x + i * 3, y: ly - 8, width: 3, height: 8, fill: diverging((i / 20 - 1) * limit, limit) }, svg);
      text(x, ly + 10, (-limit).toPrecision(2), { "font-size": 9 }); text(x + 120, ly + 10, limit.toPrecision(2), { "font-size": 9, "text-anchor": "end" });
      text(x + 130, ly, label, { "font-size": 10 });
    });
    // the query tokens to choose from
    const picker = $("neuron-queries");
    picker.replaceChildren(...v.rows.map((label, i) => {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = label; b.dataset.token = i; b.classList.toggle("active", i === t);
      return b;
    }));
    $("neuron-canvas").replaceChildren(svg);
    $("legend").hidden = true;
    $("hint").textContent = "Neuron view: pick a query token above and a head with the head buttons (the first shown is " +
      "drawn). Red is positive, blue negative; a key scores high where q and k agree in sign on large channels.";
  }

  $("neuron-queries").addEventListener("click", (e) => {
    const i = e.target.dataset && e.target.dataset.token;
    if (i !== undefined) { state.token = +i; draw(); }
  });
  $("neuron-canvas").addEventListener("mouseover", (e) => {
    const c = e.target.dataset && e.target.dataset.channel;
    if (c === undefined) return;
    e.target.setAttribute("stroke", "#000");
    $("hint").textContent = `${e.target.getAttribute("class")} of token ${e.target.dataset.index}, channel ${+c + 1}: ${e.target.dataset.value}`;
  });
  $("neuron-canvas").addEventListener("mouseout", (e) => { if (e.target.dataset && e.target.dataset.channel !== undefined) e.target.removeAttribute("stroke"); });
  return { draw };
};
