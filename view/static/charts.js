// detjac view: small SVG charts drawn by hand (line charts, heatmaps, strips); no library, nothing fetched.
// Every label is set with textContent, so text from a store is never parsed as markup.
"use strict";

const Charts = (() => {
  const el = Dom.svg;

  function titled(node, text) {  // a hover tooltip
    node.appendChild(el("title", {}, text));
    return node;
  }

  // Viridis, sampled at five stops and interpolated: t in [0, 1] -> "rgb(...)".
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function color(t) {
    const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(x));
    const f = x - i;
    const c = STOPS[i].map((a, j) => Math.round(a + f * (STOPS[i + 1][j] - a)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  function textOn(t) { return t > 0.6 ? "#000" : "#fff"; }

  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
    return ticks;
  }

  function logTicks(lo, hi) {  // 1, 2, 5 x powers of ten in [10^lo, 10^hi]; whole powers only when there are many
    const all = [], whole = [];
    for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
      for (const m of [1, 2, 5]) {
        const v = m * Math.pow(10, e), l = Math.log10(v);
        if (l < lo - 1e-9 || l > hi + 1e-9) continue;
        all.push(v);
        if (m === 1) whole.push(v);
      }
    }
    if (all.length <= 7) return all;
    const step = Math.max(1, Math.ceil(whole.length / 6));
    return whole.filter((_, i) => i % step === 0);
  }

  function short(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e4 || a < 1e-2)) return v.toExponential(0);
    return String(Number(v.toPrecision(3)));
  }

  // series: [{name, y: [...], x: [...] (default 0, 1, ...), color, width, dash, marker}]
  // opts: {width, height, logY, xLabel, yLabel, xTicks: [{at, label}], id}
  function line(series, opts = {}) {
    const W = opts.width || 560, H = opts.height || 250, L = 58, R = 12, T = opts.yLabel ? 24 : 10, B = 38;
    const svg = el("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "chart", id: opts.id,
      role: "img", "aria-label": opts.label || opts.yLabel || "chart"});
    const pts = [];
    for (const s of series) {
      s.y.forEach((y, i) => {
        const x = s.x ? s.x[i] : i;
        if (y == null || !Number.isFinite(y) || (opts.logY && y <= 0)) return;
        pts.push([x, y]);
      });
    }
    if (!pts.length) {
      svg.appendChild(el("text", {x: L, y: H / 2}, "nothing to draw"));
      return svg;
    }
    const fy = opts.logY ? (v) => Math.log10(v) : (v) => v;
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => fy(p[1]))), y1 = Math.max(...pts.map((p) => fy(p[1])));
    if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
    if (y1 === y0) { y0 -= opts.logY ? 0.5 : Math.abs(y0) * 0.1 + 0.5; y1 += opts.logY ? 0.5 : Math.abs(y1) * 0.1 + 0.5; }
    if (!opts.logY && y0 > 0 && opts.zero !== false) y0 = 0;
    const pad = (y1 - y0) * 0.05; y1 += pad; if (opts.logY) y0 -= pad;
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = (y) => T + (1 - (fy(y) - y0) / (y1 - y0)) * (H - T - B);
    const yt = opts.logY ? logTicks(y0, y1) : niceTicks(y0, y1, 5);
    for (const v of yt) {
      const y = sy(v);
      if (y < T - 1 || y > H - B + 1) continue;
      svg.appendChild(el("line", {x1: L, x2: W - R, y1: y, y2: y, class: "grid"}));
      svg.appendChild(el("text", {x: L - 5, y: y + 4, "text-anchor": "end"}, short(v)));
    }
    const xt = opts.xTicks || niceTicks(x0, x1, Math.min(8, Math.max(1, Math.round(x1 - x0))))
      .filter(Number.isInteger).map((v) => ({at: v, label: String(v)}));
    for (const t of xt) {
      svg.appendChild(el("text", {x: sx(t.at), y: H - B + 14, "text-anchor": "middle"}, t.label));
    }
    svg.appendChild(el("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
    svg.appendChild(el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
    if (opts.xLabel) svg.appendChild(el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, opts.xLabel));
    if (opts.yLabel) {
      svg.appendChild(el("text", {x: 4, y: 12, class: "y-label"}, opts.yLabel));
    }
    for (const s of series) {
      const d = [];
      s.y.forEach((y, i) => {
        const x = s.x ? s.x[i] : i;
        if (y == null || !Number.isFinite(y) || (opts.logY && y <= 0)) return;
        d.push(`${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
      });
      if (!d.length) continue;
      const path = el("polyline", {points: d.join(" "), fill: "none", stroke: s.color || "#2a62b8",
        "stroke-width": s.width || 1.5, "stroke-dasharray": s.dash, "data-series": s.name, opacity: s.opacity});
      svg.appendChild(titled(path, s.name));
      if (s.marker) {
        s.y.forEach((y, i) => {
          const x = s.x ? s.x[i] : i;
          if (y == null || !Number.isFinite(y) || (opts.logY && y <= 0)) return;
          svg.appendChild(titled(el("circle", {cx: sx(x), cy: sy(y), r: 3, fill: s.color || "#2a62b8"}),
            `${s.name}: ${short(y)} at ${x}`));
        });
      }
    }
    return svg;
  }

  // A matrix of values as coloured cells. opts: {rowLabels, colLabels, shade(v) -> t in [0, 1], text(v), tip(r, c, v),
  // onClick(r, c), picked: [r, c] or column index, cell, id}
  function heatmap(matrix, opts = {}) {
    const rows = matrix.length, cols = rows ? matrix[0].length : 0;
    const rowLabelWidth = 8 + 7 * Math.max(0, ...(opts.rowLabels || []).map((s) => String(s).length));
    const cw = opts.cell || Math.max(14, Math.min(46, Math.floor(((opts.maxWidth || 700) - rowLabelWidth - 10)
      / Math.max(1, cols))));
    const ch = opts.rowHeight || 22;
    const rowLabels = opts.rowLabels || [], colLabels = opts.colLabels || [];
    const L = opts.left != null ? opts.left : rowLabelWidth;
    const B = opts.bottom != null ? opts.bottom : 10 + 6 * Math.min(18, Math.max(0, ...colLabels.map((s) => String(s).length)));
    const W = L + cols * cw + 10, H = 6 + rows * ch + B;
    const svg = el("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "heatmap", id: opts.id,
      role: "img", "aria-label": opts.label || "heatmap"});
    rowLabels.forEach((label, r) => {
      svg.appendChild(el("text", {x: L - 6, y: 6 + r * ch + ch / 2 + 4, "text-anchor": "end"}, label));
    });
    colLabels.forEach((label, c) => {
      const x = L + c * cw + cw / 2, y = 6 + rows * ch + 8;
      const shown = String(label).length > 18 ? String(label).slice(0, 17) + "…" : String(label);
      const t = el("text", {x, y, "text-anchor": "end", transform: `rotate(-45 ${x} ${y})`, class: "col-label"}, shown);
      svg.appendChild(titled(t, label));
    });
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const v = matrix[r][c];
        const t = opts.shade ? opts.shade(v) : v;
        const x = L + c * cw, y = 6 + r * ch;
        const picked = Array.isArray(opts.picked) ? opts.picked[0] === r && opts.picked[1] === c : opts.picked === c;
        const rect = el("rect", {x: x + 1, y: y + 1, width: cw - 2, height: ch - 2, rx: 2, fill: v == null ? "#eee" : color(t),
          class: "cell", "data-row": r, "data-col": c, stroke: picked ? "#f4b400" : null, "stroke-width": picked ? 3 : null});
        if (opts.onClick) {
          rect.style.cursor = "pointer";
          rect.addEventListener("click", () => opts.onClick(r, c));
        }
        svg.appendChild(titled(rect, opts.tip ? opts.tip(r, c, v) : String(v)));
        if (opts.text && v != null && 6.5 * String(opts.text(v)).length + 4 <= cw) {  // when it fits
          const label = el("text", {x: x + cw / 2, y: y + ch / 2 + 4, "text-anchor": "middle", fill: textOn(t),
            "pointer-events": "none"}, opts.text(v));
          label.style.fill = textOn(t);
          svg.appendChild(label);
        }
      }
    }
    return svg;
  }

  return {line, heatmap, color, short};
})();
