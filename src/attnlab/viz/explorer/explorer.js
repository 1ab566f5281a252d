/* attnlab attention explorer. Reads the JSON payload in #attnlab-data (its format is documented
   in attnlab/viz/explorer/__init__.py): views of (layers, heads, T, S) weights, one base64 string
   per layer, decoded the first time a layer is drawn. Makes no network request. */
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("attnlab-data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#843c39", "#7b4173"];
  const $ = (id) => document.getElementById(id);
  // every head is shown at first, so that a reader need not discover there are others; past 128
  // queries the first head alone, as thousands of lines of every head would be a grey wall
  const allHeads = (v) => new Set(Array.from({ length: v.rows.length > 128 ? 1 : v.heads }, (_, h) => h));
  const state = { view: 0, layer: 0, heads: allHeads(DATA.views[0]), tab: DATA.views[0].image ? "image" : "head", focus: null,
                  enlarged: null, links: 0, query: null, token: 0 };
  const decoded = new Map();

  const color = (h) => COLORS[h % COLORS.length];
  const view = () => DATA.views[state.view];

  // draw.js: the colour map, its legend, the hover box, SVG elements and their rasterising
  const { colormap, legend, tip, svgText, svgDataUrl, rasterise } = window.attnlabDraw;
  const svgEl = window.attnlabDraw.svgEl;

  // ------------------------------------------------------------------ data
  function layerData(v, l) {
    const key = v.name + "#" + l;
    if (decoded.has(key)) return decoded.get(key);
    const text = atob(v.data[l]), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    const T = v.rows.length, S = v.cols.length, H = v.heads;
    let d;
    if (v.encoding === "dense") {
      d = { dense: bytes, T, S };
    } else {
      const n = H * T * v.k;
      d = { index: new Uint16Array(bytes.buffer, 0, n), values: bytes.subarray(2 * n, 3 * n),
            rest: bytes.subarray(3 * n, 3 * n + H * T), k: v.k, T, S };
    }
    if (v.rowmax) {                     // a view over a picture: each row quantised against its own maximum
      const t = atob(v.rowmax[l]), b = new Uint8Array(t.length);
      for (let i = 0; i < t.length; i++) b[i] = t.charCodeAt(i);
      d.rowmax = new Float32Array(b.buffer);
    }
    decoded.set(key, d);
    return d;
  }

  // what a byte of row (h, t) is multiplied by, besides 1/255
  const rowScale = (d, h, t) => (d.rowmax ? d.rowmax[h * d.T + t] : 1);

  // the strongest keys of query t in head h: [[key, weight], ...] strongest first, and the weight left out
  function rowLinks(d, h, t, limit) {
    let out = [], rest = 0;
    const f = rowScale(d, h, t) / 255;
    if (d.dense) {
      const base = (h * d.T + t) * d.S;
      for (let s = 0; s < d.S; s++) { const w = d.dense[base + s]; if (w) out.push([s, w * f]); }
      out.sort((a, b) => b[1] - a[1]);
      for (let i = limit; i < out.length; i++) rest += out[i][1];
    } else {
      const base = (h * d.T + t) * d.k;
      for (let i = 0; i < d.k; i++) { const w = d.values[base + i]; if (w) out.push([d.index[base + i], w * f]); }
      for (let i = limit; i < out.length; i++) rest += out[i][1];
      rest += d.rest[h * d.T + t] / 255;
    }
    return [out.slice(0, limit), rest];
  }

  // ------------------------------------------------------------------ controls
  function fillControls() {
    const vs = $("view-select");
    vs.innerHTML = "";
    DATA.views.forEach((v, i) => vs.add(new Option(v.title + (v.kind === "matrix" ? " (matrix)" : ""), i)));
    vs.value = state.view;
    const ls = $("layer-select"), v = view();
    ls.innerHTML = "";
    for (let l = 0; l < v.layers; l++) ls.add(new Option(String(l + 1), l));
    state.layer = Math.min(state.layer, v.layers - 1);
    ls.value = state.layer;
    const heads = $("heads");
    heads.innerHTML = "";
    state.heads = new Set([...state.heads].filter((h) => h < v.heads));
    if (!state.heads.size) state.heads = allHeads(v);
    for (let h = 0; h < v.heads; h++) {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = "h" + (h + 1); b.dataset.head = h;
      b.style.borderColor = color(h);
      b.title = "head " + (h + 1) + ": click to show or hide, double-click to show it alone";
      heads.appendChild(b);
    }
    $("tab-image").hidden = !v.image;
    $("tab-neuron").hidden = !v.neurons;
    if (state.tab === "image" && !v.image) state.tab = "head";
    if (state.tab === "neuron" && !v.neurons) state.tab = "head";
    if (!state.links) state.links = v.rows.length > 256 ? 3 : 8;
    $("links").value = state.links;
    markHeads();
  }

  function markHeads() {
    for (const b of $("heads").children) b.classList.toggle("off", !state.heads.has(+b.dataset.head));
  }

  // ------------------------------------------------------------------ head view
  function labelWidth(labels) {
    let m = 1;
    for (const s of labels) m = Math.max(m, s.length);
    return Math.min(m, 24) * 7.5 + 12;
  }

  // the head view's frame (tokens, caption) is drawn once per view, layer and head choice; a
  // hover redraws only the lines, so that a long input answers at once
  let frame = null;
  function drawHeadView() {
    const v = view(), T = v.rows.length, S = v.cols.length;
    const rowH = T > 200 || S > 200 ? 13 : 18, lw = labelWidth(v.rows), rw = labelWidth(v.cols);
    const xl = lw + 14, xr = xl + 260, width = xr + rw + 10, top = 24;
    const height = top + Math.max(T, S) * rowH + 10;
    const svg = svgEl("svg", { xmlns: SVGNS, width, height, viewBox: `0 0 ${width} ${height}`, id: "head-svg" });
    svgEl("rect", { x: 0, y: 0, width, height, fill: "#ffffff" }, svg);
    const caption = svgEl("text", { x: 4, y: 14, fill: "#444", "font-size": 12 }, svg);
    caption.textContent = `${v.title}, layer ${state.layer + 1}, heads ${[...state.heads].sort((a, b) => a - b).map((h) => h + 1).join(" ") || "none"}`;
    const y = (i) => top + i * rowH + rowH / 2;
    const lines = svgEl("g", { id: "lines" }, svg), rests = svgEl("g", { id: "rests" }, svg);
    const tokens = (labels, x, anchor, side) => {
      const g = svgEl("g", { class: "tokens-" + side }, svg);
      labels.forEach((s, i) => {
        const e = svgEl("text", { x, y: y(i) + 4, "text-anchor": anchor, fill: "#222", "data-side": side, "data-index": i }, g);
        e.textContent = s.length > 24 ? s.slice(0, 23) + "…" : s;
      });
      return g;
    };
    frame = { v, xl, xr, y, lines, rests, q: tokens(v.rows, xl - 14, "end", "q"), k: tokens(v.cols, xr + 6, "start", "k"), bold: null };
    $("head-view").replaceChildren(svg);
    drawLines();
    $("hint").textContent = `Lines: each query (left) to its ${state.links} strongest keys (right), one colour per head, ` +
      `opacity = weight; a grey bar is the weight of the keys not drawn. Hover a token to see only its lines.`;
  }

  function drawLines() {
    const { v, xl, xr, y, lines, rests } = frame, d = layerData(v, state.layer), T = v.rows.length;
    const f = state.focus, heads = [...state.heads].sort((a, b) => a - b);
    const lineSet = document.createDocumentFragment(), restSet = document.createDocumentFragment();
    for (const h of heads) {
      for (let t = 0; t < T; t++) {
        if (f && f.side === "q" && f.index !== t) continue;
        const [links, rest] = rowLinks(d, h, t, state.links);
        for (const [s, w] of links) {
          if (f && f.side === "k" && f.index !== s) continue;
          svgEl("line", { x1: xl, y1: y(t), x2: xr, y2: y(s), stroke: color(h), "stroke-width": 2,
                          "stroke-opacity": Math.min(1, w * (f ? 1.5 : 1)).toFixed(3),
                          "data-q": t, "data-k": s, "data-h": h }, lineSet);
        }
        if (rest > 0.02 && !(f && f.side === "k"))
          svgEl("rect", { x: xl - 10, y: y(t) - 3 + (heads.indexOf(h) % 3), width: 8 * rest + 1, height: 2,
                          fill: "#999", "data-q": t, "data-rest": rest.toFixed(3) }, restSet);
      }
    }
    lines.replaceChildren(lineSet);
    rests.replaceChildren(restSet);
    drawValues(f, heads, d);
    if (frame.bold) frame.bold.removeAttribute("font-weight");
    frame.bold = f ? frame[f.side].children[f.index] : null;
    if (frame.bold) frame.bold.setAttribute("font-weight", "bold");
  }

  // hovering a query writes its weight beside every key it gives more than 0.005 (the first
  // head shown); hovering a key, beside every query that reads it
  function drawValues(f, heads, d) {
    const { v, xl, xr, y } = frame;
    let g = document.getElementById("values");
    if (!g) g = svgEl("g", { id: "values" }, $("head-svg"));
    g.replaceChildren();
    if (!f || !heads.length) return;
    const h = heads[0];
    if (f.side === "q") {
      const row = rowVector(d, h, f.index);
      row.forEach((w, s) => { if (w * v.scale >= 0.005) {
        const e = svgEl("text", { x: xr - 4, y: y(s) + 4, "text-anchor": "end", fill: color(h), "font-size": 10, class: "weight", "data-k": s }, g);
        e.textContent = (w * v.scale).toFixed(3); } });
    } else {
      for (let t = 0; t < v.rows.length; t++) {
        const w = rowVector(d, h, t)[f.index] * v.scale;
        if (w < 0.005) continue;
        const e = svgEl("text", { x: xl + 4, y: y(t) + 4, fill: color(h), "font-size": 10, class: "weight", "data-q": t }, g);
        e.textContent = w.toFixed(3);
      }
    }
  }

  // ------------------------------------------------------------------ colour scale
  // one scale per view: 0 to the view's "top" (payload docs), the same for every layer and head
  const topOf = (v) => v.top || 1;

  const drawLegend = (top, label) => legend($("legend"), top, label);

  // ------------------------------------------------------------------ model view
  function heatmap(d, h, size) {
    // max over the cells each pixel covers, so a sharp link stays visible in a small thumbnail
    const rows = Math.min(size, d.T), cols = Math.min(size, d.S), px = new Float32Array(rows * cols);
    const put = (t, s, w) => { const i = Math.floor(t * rows / d.T) * cols + Math.floor(s * cols / d.S); if (w > px[i]) px[i] = w; };
    for (let t = 0; t < d.T; t++) {
      const f = rowScale(d, h, t);
      if (d.dense) { const base = (h * d.T + t) * d.S; for (let s = 0; s < d.S; s++) put(t, s, d.dense[base + s] * f); }
      else { const base = (h * d.T + t) * d.k; for (let i = 0; i < d.k; i++) put(t, d.index[base + i], d.values[base + i] * f); }
    }
    const top = 255 * topOf(view());
    const img = new ImageData(cols, rows);
    for (let i = 0; i < px.length; i++) {
      const c = colormap(px[i] / top);
      img.data[4 * i] = c[0]; img.data[4 * i + 1] = c[1]; img.data[4 * i + 2] = c[2]; img.data[4 * i + 3] = 255;
    }
    return img;
  }

  function paint(canvas, img, width, height) {
    const tmp = document.createElement("canvas");
    tmp.width = img.width; tmp.height = img.height;
    tmp.getContext("2d").putImageData(img, 0, 0);
    canvas.width = width; canvas.height = height;
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(tmp, 0, 0, width, height);
    return ctx;
  }

  let modelJob = 0;
  function drawModelView() {
    const v = view(), grid = $("thumbs"), job = ++modelJob;
    if (state.enlarged) return drawEnlarged();
    $("enlarged").hidden = true;
    grid.hidden = false;
    grid.replaceChildren();
    const size = v.layers * v.heads > 144 ? 48 : 72;
    grid.style.gridTemplateColumns = `3em repeat(${v.heads}, ${size + 2}px)`;
    grid.appendChild(Object.assign(document.createElement("span"), { className: "collabel" }));
    for (let h = 0; h < v.heads; h++)
      grid.appendChild(Object.assign(document.createElement("span"), { className: "collabel", textContent: "h" + (h + 1) }));
    const row = (l) => {
      if (job !== modelJob) return;               // the view changed while rows were still being drawn
      const d = layerData(v, l);
      grid.appendChild(Object.assign(document.createElement("span"), { className: "rowlabel", textContent: "L" + (l + 1) }));
      for (let h = 0; h < v.heads; h++) {
        const c = document.createElement("canvas");
        c.dataset.layer = l; c.dataset.head = h; c.title = `layer ${l + 1}, head ${h + 1}: click to enlarge`;
        paint(c, heatmap(d, h, size), size, size);
        grid.appendChild(c);
      }
      if (l + 1 < v.layers) requestAnimationFrame(() => row(l + 1));
      else grid.dataset.complete = "1";
    };
    grid.dataset.complete = "";
    row(0);
    drawLegend(topOf(v) * v.scale, v.kind === "matrix" ? "value" : "weight");
    $("hint").textContent = "Every layer (rows) and head (columns), on one colour scale (the legend): rows of a panel " +
      "are queries, columns keys. Hover for the value, click a panel to enlarge it.";
  }

  function drawEnlarged() {
    $("thumbs").hidden = true;
    $("enlarged").hidden = false;
    enlargedGeometry = renderEnlarged($("enlarged-canvas"), 1);
    const v = view();
    drawLegend(topOf(v) * v.scale, v.kind === "matrix" ? "value" : "weight");
    $("hint").textContent = "One head, large, on the view's colour scale (the legend). Hover a cell for its value.";
  }

  let enlargedGeometry = null;
  // draws the enlarged head into ``canvas`` at ``s`` device pixels per pixel; returns where the cells are
  function renderEnlarged(canvas, s) {
    const v = view(), { layer, head } = state.enlarged, d = layerData(v, layer);
    const T = v.rows.length, S = v.cols.length, labelled = Math.max(T, S) <= 64;
    const cell = Math.max(1, Math.min(24, Math.floor(640 / Math.max(T, S))));
    const margin = labelled ? labelWidth(v.rows.concat(v.cols)) : 10, top = 24;
    const img = heatmap(d, head, 1024);
    const w = Math.max(cell * S, Math.min(S, 1024)), hgt = Math.max(cell * T, Math.min(T, 1024));
    const caption = `${v.title}, layer ${layer + 1}, head ${head + 1} (rows: queries, columns: keys)`;
    let ctx = canvas.getContext("2d");
    ctx.font = "12px sans-serif";
    // wide enough for the caption too: a short input's heatmap is narrower than its title
    const width = Math.max(margin + w + 10, Math.ceil(ctx.measureText(caption).width) + 8), height = top + hgt + margin;
    canvas.width = width * s; canvas.height = height * s;
    ctx = canvas.getContext("2d");
    ctx.setTransform(s, 0, 0, s, 0, 0);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, width, height);
    const tmp = document.createElement("canvas");
    tmp.width = img.width; tmp.height = img.height;
    tmp.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(tmp, margin, top, w, hgt);
    ctx.fillStyle = "#222"; ctx.font = "12px sans-serif";
    ctx.fillText(caption, 4, 15);
    if (labelled) {
      ctx.font = "11px monospace"; ctx.textAlign = "right";
      v.rows.forEach((s, i) => ctx.fillText(s.slice(0, 24), margin - 4, top + (i + 0.7) * hgt / T));
      ctx.save();
      v.cols.forEach((label, i) => {
        ctx.setTransform(s, 0, 0, s, s * (margin + (i + 0.7) * w / S), s * (top + hgt + 4));
        ctx.rotate(-Math.PI / 2); ctx.fillText(label.slice(0, 24), 0, 0);
      });
      ctx.restore();
    }
    return { margin, top, w, hgt, T, S, layer, head };
  }

  // ------------------------------------------------------------------ image view
  // one query's weights over every key, as floats (both encodings hold every nonzero weight of
  // a view over a picture: see the payload's documentation)
  function rowVector(d, h, t) {
    const out = new Float32Array(d.S), f = rowScale(d, h, t) / 255;
    if (d.dense) {
      const base = (h * d.T + t) * d.S;
      for (let s = 0; s < d.S; s++) out[s] = d.dense[base + s] * f;
    } else {
      const base = (h * d.T + t) * d.k;
      for (let i = 0; i < d.k; i++) if (d.values[base + i]) out[d.index[base + i]] = d.values[base + i] * f;
    }
    return out;
  }

  const pictures = new Map(), IMAGE_TOP = 34;          // the caption's height above the picture
  function picture(index) {
    if (!pictures.has(index)) {
      const img = new Image();
      img.onload = () => { if (state.tab === "image") drawImageView(); };
      img.src = DATA.images[index];
      pictures.set(index, img);
    }
    return pictures.get(index);
  }

  // the class token where there is one; else the middle patch (a Swin), or the one row a view has
  function defaultQuery(v) {
    const g = v.image;
    if (v.rows.length !== v.cols.length || g.prefix) return 0;
    return g.prefix + Math.floor(g.rows / 2) * g.cols + Math.floor(g.cols / 2);
  }

  function drawQueryButtons(v) {
    const box = $("image-queries"), g = v.image, ids = [];
    for (let i = 0; i < g.prefix && i < v.rows.length; i++) ids.push(i);
    if (v.rows.length !== v.cols.length) ids.splice(0, ids.length, ...v.rows.map((_, i) => i));
    box.replaceChildren(...ids.map((i) => {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = v.rows[i]; b.dataset.query = i;
      b.classList.toggle("active", state.query === i);
      return b;
    }));
  }

  // the weights the image view shows: query state.query's row, averaged over the heads shown
  function imageWeights(v) {
    const d = layerData(v, state.layer), heads = [...state.heads].sort((a, b) => a - b), g = v.image;
    const w = new Float32Array(d.S);
    for (const h of heads) { const r = rowVector(d, h, state.query); for (let s = 0; s < d.S; s++) w[s] += r[s] / heads.length; }
    let top = 0;
    for (let i = g.prefix; i < d.S; i++) top = Math.max(top, w[i]);
    return { w, top, heads };
  }

  function drawImageView() {
    const v = view(), g = v.image, canvas = $("image-canvas");
    const img = picture(g.index);
    if (state.query === null || state.query >= v.rows.length) state.query = defaultQuery(v);
    drawQueryButtons(v);
    if (!img.complete || !img.naturalWidth) return;           // drawn by the picture's onload
    const top = renderImage(canvas, 1);
    canvas.dataset.query = state.query;
    canvas.dataset.picture = img.naturalWidth;
    drawLegend(top * v.scale, "weight (this query)");
    $("hint").textContent = "Each patch tinted by the weight the query gives it (the legend: 0 clear, the brightest patch " +
      "yellow), averaged over the heads shown; the tint's opacity grows with the weight, so the picture shows through. " +
      "Hover a patch for its weight; click it to make it the query" + (g.prefix ? ", or a button above for a class token." : ".");
  }

  // draws the picture and its tint into ``canvas`` at ``s`` device pixels per pixel; returns the brightest weight
  function renderImage(canvas, s) {
    const v = view(), g = v.image, img = picture(g.index), { w, top, heads } = imageWeights(v);
    const zoom = Math.max(1, Math.floor(448 / Math.max(img.naturalWidth, img.naturalHeight)));
    const W = img.naturalWidth * zoom, H = img.naturalHeight * zoom, caption = IMAGE_TOP;
    canvas.width = W * s; canvas.height = (H + caption) * s;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(s, 0, 0, s, 0, 0);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H + caption);
    ctx.imageSmoothingEnabled = zoom < 4;
    ctx.drawImage(img, 0, caption, W, H);
    const [ch, cw] = [g.cell[0] * zoom, g.cell[1] * zoom];
    for (let r = 0; r < g.rows; r++) {
      for (let c = 0; c < g.cols; c++) {
        const x = top > 0 ? w[g.prefix + r * g.cols + c] / top : 0, rgb = colormap(x);
        // opacity follows the weight (its square root, so that middling weights show): a patch
        // the query ignores leaves the picture as it is, the brightest keeps a quarter of it
        ctx.fillStyle = `rgba(${rgb[0] | 0},${rgb[1] | 0},${rgb[2] | 0},${(0.75 * Math.sqrt(x)).toFixed(3)})`;
        ctx.fillRect(c * cw, caption + r * ch, Math.min(cw, W - c * cw), Math.min(ch, H - r * ch));
      }
    }
    const q = state.query - g.prefix;
    if (v.rows.length === v.cols.length && q >= 0) {
      ctx.strokeStyle = "#e6194b"; ctx.lineWidth = 2;
      ctx.strokeRect((q % g.cols) * cw + 1, caption + Math.floor(q / g.cols) * ch + 1, cw - 2, ch - 2);
    }
    const prefix = v.cols.slice(0, g.prefix).map((label, i) => `${label} ${(w[i] * v.scale).toFixed(2)}`).join(", ");
    ctx.fillStyle = "#222"; ctx.font = "12px sans-serif";
    ctx.fillText(`${v.title}, layer ${state.layer + 1}, heads ${heads.map((h) => h + 1).join(" ") || "none"}`, 4, 13);
    ctx.fillText(`query ${v.rows[state.query]}: brightest patch ${(top * v.scale).toFixed(3)}` +
                 (prefix ? `; to ${prefix}` : ""), 4, 28);
    return top;
  }

  // which patch of the image view a mouse event is over, or null
  function patchAt(e) {
    const v = view(), g = v.image, canvas = $("image-canvas");
    if (!g) return null;
    const box = canvas.getBoundingClientRect(), zoom = canvas.width / picture(g.index).naturalWidth;
    const x = (e.clientX - box.left) * canvas.width / box.width, y = (e.clientY - box.top) * canvas.height / box.height - IMAGE_TOP;
    const r = Math.floor(y / (g.cell[0] * zoom)), c = Math.floor(x / (g.cell[1] * zoom));
    return r < 0 || c < 0 || r >= g.rows || c >= g.cols ? null : g.prefix + r * g.cols + c;
  }

  // ------------------------------------------------------------------ values on hover
  function cellText(v, l, h, t, s) {
    const w = rowVector(layerData(v, l), h, t)[s] * v.scale;
    return `layer ${l + 1}, head ${h + 1}: ${v.rows[t]} → ${v.cols[s]}: ${w.toFixed(4)}`;
  }

  // ------------------------------------------------------------------ drawing and events
  function draw() {
    for (const tab of ["head", "model", "image", "neuron"]) {
      $(tab + "-view").hidden = state.tab !== tab;
      $("tab-" + tab).classList.toggle("active", state.tab === tab);
    }
    $("legend").hidden = state.tab === "head";
    if (state.tab === "head") drawHeadView(); else if (state.tab === "image") drawImageView();
    else if (state.tab === "neuron") neuron.draw(); else drawModelView();
  }

  // a head choice redraws what shows it
  function headsChanged() {
    markHeads();
    if (state.tab === "head") drawHeadView(); else if (state.tab === "image") drawImageView();
    else if (state.tab === "neuron") neuron.draw();
  }

  function on(id, event, handler) { $(id).addEventListener(event, handler); }

  on("view-select", "change", (e) => {
    state.view = +e.target.value; state.focus = null; state.enlarged = null; state.links = 0; state.query = null;
    fillControls(); draw();
  });
  on("layer-select", "change", (e) => { state.layer = +e.target.value; state.focus = null; if (state.enlarged) state.enlarged.layer = state.layer; draw(); });
  on("links", "change", (e) => { state.links = Math.max(1, Math.min(64, Math.round(+e.target.value) || 1)); draw(); });
  on("tab-head", "click", () => { state.tab = "head"; draw(); });
  on("tab-model", "click", () => { state.tab = "model"; draw(); });
  on("tab-image", "click", () => { state.tab = "image"; draw(); });
  on("tab-neuron", "click", () => { state.tab = "neuron"; draw(); });
  on("image-queries", "click", (e) => {
    const q = e.target.dataset && e.target.dataset.query;
    if (q !== undefined) { state.query = +q; drawImageView(); }
  });
  on("image-canvas", "click", (e) => {
    const v = view(), key = patchAt(e);
    if (key === null || v.rows.length !== v.cols.length) return;        // a view with one query row: nothing to pick
    state.query = key; drawImageView();
  });
  on("image-canvas", "mousemove", (e) => {
    const v = view(), key = patchAt(e);
    if (key === null) return tip($("tip"), e, null);
    const { w } = imageWeights(v);
    tip($("tip"), e, `${v.rows[state.query]} → ${v.cols[key]}: ${(w[key] * v.scale).toFixed(4)} (mean of the heads shown)`);
  });
  on("image-canvas", "mouseleave", (e) => tip($("tip"), e, null));
  on("thumbs", "mousemove", (e) => {
    const c = e.target;
    if (c.tagName !== "CANVAS") return tip($("tip"), e, null);
    const v = view(), box = c.getBoundingClientRect();
    const t = Math.min(v.rows.length - 1, Math.floor((e.clientY - box.top) / box.height * v.rows.length));
    const s = Math.min(v.cols.length - 1, Math.floor((e.clientX - box.left) / box.width * v.cols.length));
    tip($("tip"), e, cellText(v, +c.dataset.layer, +c.dataset.head, t, s));
  });
  on("thumbs", "mouseleave", (e) => tip($("tip"), e, null));
  on("enlarged-canvas", "mousemove", (e) => {
    const g = enlargedGeometry, c = $("enlarged-canvas"), box = c.getBoundingClientRect();
    const x = (e.clientX - box.left) * c.width / box.width - g.margin, y = (e.clientY - box.top) * c.height / box.height - g.top;
    if (x < 0 || y < 0 || x >= g.w || y >= g.hgt) return tip($("tip"), e, null);
    tip($("tip"), e, cellText(view(), g.layer, g.head, Math.floor(y * g.T / g.hgt), Math.floor(x * g.S / g.w)));
  });
  on("enlarged-canvas", "mouseleave", (e) => tip($("tip"), e, null));
  on("close-enlarged", "click", () => { state.enlarged = null; draw(); });
  on("heads", "click", (e) => {
    const h = e.target.dataset && e.target.dataset.head;
    if (h === undefined) return;
    if (state.heads.has(+h)) state.heads.delete(+h); else state.heads.add(+h);
    headsChanged();
  });
  on("heads", "dblclick", (e) => {
    const h = e.target.dataset && e.target.dataset.head;
    if (h === undefined) return;
    state.heads = new Set([+h]); headsChanged();
  });
  on("thumbs", "click", (e) => {
    const c = e.target;
    if (c.tagName !== "CANVAS") return;
    state.enlarged = { layer: +c.dataset.layer, head: +c.dataset.head };
    state.layer = state.enlarged.layer; state.heads = new Set([state.enlarged.head]);
    $("layer-select").value = state.layer; markHeads();
    draw();
  });
  on("head-view", "mouseover", (e) => {
    const side = e.target.dataset && e.target.dataset.side;
    if (!side) return;
    const index = +e.target.dataset.index;
    if (state.focus && state.focus.side === side && state.focus.index === index) return;
    state.focus = { side, index }; drawLines();
  });
  on("head-view", "mouseleave", () => { if (state.focus) { state.focus = null; drawLines(); } });

  // ------------------------------------------------------------------ export
  // the current canvas view drawn afresh at ``s`` device pixels per pixel (not an enlarged screenshot)
  function currentCanvas(s) {
    const c = document.createElement("canvas");
    if (state.tab === "image") { renderImage(c, s); return c; }
    if (state.enlarged) { renderEnlarged(c, s); return c; }
    const v = view(), thumbs = [...$("thumbs").querySelectorAll("canvas")];
    if (!thumbs.length) return null;
    const size = thumbs[0].width, gap = 3, left = 30, top = 20;
    c.width = s * (left + v.heads * (size + gap)); c.height = s * (top + v.layers * (size + gap));
    const ctx = c.getContext("2d");
    ctx.setTransform(s, 0, 0, s, 0, 0);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, c.width, c.height);
    ctx.fillStyle = "#222"; ctx.font = "11px sans-serif";
    ctx.imageSmoothingEnabled = false;
    for (let l = 0; l < v.layers; l++) {
      const d = layerData(v, l);
      for (let h = 0; h < v.heads; h++) {
        const cell = document.createElement("canvas");
        paint(cell, heatmap(d, h, size * s), size * s, size * s);
        ctx.drawImage(cell, left + h * (size + gap), top + l * (size + gap), size, size);
        if (h === 0) ctx.fillText("L" + (l + 1), 2, top + l * (size + gap) + size / 2);
        if (l === 0) ctx.fillText("h" + (h + 1), left + h * (size + gap) + size / 2 - 6, 14);
      }
    }
    return c;
  }

  // resolves to {png, svg}: data URLs of the current view; ``scale`` (default: the page's PNG
  // resolution choice) multiplies the PNG's pixels, redrawn at that size
  function exportView(scale) {
    const s = scale || +$("png-scale").value || 1;
    if (state.tab === "head") return rasterise($("head-svg"), s);
    if (state.tab === "neuron") return rasterise($("neuron-svg"), s);
    const c = currentCanvas(s);
    if (!c) return Promise.reject(new Error("nothing drawn yet"));
    const png = c.toDataURL("image/png"), w = c.width / s, h = c.height / s;
    const svg = svgEl("svg", { xmlns: SVGNS, width: w, height: h, viewBox: `0 0 ${w} ${h}` });
    svgEl("image", { href: png, x: 0, y: 0, width: w, height: h }, svg);
    return Promise.resolve({ png, svg: svgDataUrl(svgText(svg)) });
  }

  function download(kind) {
    exportView().then((urls) => {
      const a = $("download-" + kind);
      a.href = urls[kind];
      a.click();
    }).catch((e) => { $("hint").textContent = "export failed: " + e.message; });
  }
  on("export-png", "click", () => download("png"));
  on("export-svg", "click", () => download("svg"));

  // what the browser tests read: the state, the current view, one query's weights in the current layer
  window.attnlabExplorer = { state, exportView, draw, view,
                             rowVector: (h, t) => Array.from(rowVector(layerData(view(), state.layer), h, t)),
                             imageRow: () => Array.from(imageWeights(view()).w), pictureElement: () => picture(view().image.index) };
  // the neuron view (neuron.js, defined before this script) draws with these
  const neuron = window.attnlabNeuronView({ state, view, $, svgEl, colormap, color, drawLegend, rowVector, layerData, SVGNS });
  fillControls();
  draw();
  requestAnimationFrame(() => requestAnimationFrame(() => {
    // the first frame with the head view on screen
    window.attnlabReady = performance.now();
    document.body.dataset.ready = "1";
  }));
})();
