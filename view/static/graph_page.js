// detjac view: an attribution graph (circuit-tracer's graph JSON as `detjac graph` writes it), drawn by hand in SVG.
// Rows are layers (the prompt's tokens at the bottom, the logits at the top), columns the prompt's positions; a link's
// width is its |weight|, its colour its sign. Click a node for its labels and edges; the sliders hide nodes and links.
// Every label (token texts, clerps) is set with textContent only: text from a graph is never parsed as markup.
"use strict";

const GraphPage = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = {positive: "#2a62b8", negative: "#d0543e"};
  const STEP = 13;  // pixels between two nodes of one cell
  const LEFT = 78, TOP = 14, BOTTOM = 40;

  function svg(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v != null) e.setAttribute(k, String(v));
    if (text != null) e.textContent = String(text);
    return e;
  }

  function h(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) if (c != null && c !== false) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  function num(x, digits = 4) {
    if (x == null) return "–";
    const v = Number(x), a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(digits - 1);
    return String(Number(v.toPrecision(digits)));
  }

  const isNeuron = (n) => n.type !== "embedding" && n.type !== "logit";

  // What the thresholds keep. Nodes: tokens and logits always; a neuron while its influence (the cumulative share of
  // influence down to it, as `detjac graph` writes it) is at most `nodeT`. Links between kept nodes, largest |weight|
  // first, while the |weight| taken before them is below `edgeT` of their total (1: every link).
  function visible(data, nodeT, edgeT) {
    const nodes = new Set(data.nodes.filter((n) => !isNeuron(n) || n.influence == null || n.influence <= nodeT + 1e-12)
      .map((n) => n.id));
    const candidates = data.links.filter((l) => nodes.has(l.source) && nodes.has(l.target))
      .sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight));
    const total = candidates.reduce((s, l) => s + Math.abs(l.weight), 0);
    const links = [];
    let taken = 0;
    for (const l of candidates) {
      if (edgeT < 1 && taken >= edgeT * total) break;
      links.push(l);
      taken += Math.abs(l.weight);
    }
    return {nodes, links};
  }

  // Positions of every node (kept fixed while the thresholds change): a cell per (row, position), its nodes in lines.
  function layout(data) {
    const tokens = data.metadata.prompt_tokens;
    const nCols = Math.max(tokens.length, ...data.nodes.map((n) => n.ctx + 1));
    const rows = [...new Set(data.nodes.map((n) => n.row))].sort((a, b) => a - b);
    const maxRow = rows.length ? rows[rows.length - 1] : 0;
    const cells = new Map();
    for (const n of data.nodes) {
      const key = `${n.row}/${n.ctx}`;
      if (!cells.has(key)) cells.set(key, []);
      cells.get(key).push(n);
    }
    const most = Math.max(1, ...[...cells.values()].map((c) => c.length));
    const perLine = Math.max(4, Math.min(14, Math.ceil(Math.sqrt(2 * most))));
    const colW = perLine * STEP + 18;
    const lines = (row) => Math.max(1, ...Array.from({length: nCols}, (_, c) =>
      Math.ceil((cells.get(`${row}/${c}`) || []).length / perLine)));
    const allRows = Array.from({length: maxRow + 1}, (_, r) => r);  // every layer, empty ones too
    const rowH = new Map(allRows.map((r) => [r, Math.max(34, lines(r) * STEP + 18)]));
    const height = TOP + allRows.reduce((s, r) => s + rowH.get(r), 0) + BOTTOM;
    const rowTop = new Map();
    let y = height - BOTTOM;
    for (const r of allRows) { y -= rowH.get(r); rowTop.set(r, y); }
    const at = new Map();
    for (const [key, members] of cells) {
      const [row, col] = key.split("/").map(Number);
      members.sort((a, b) => (a.influence ?? 0) - (b.influence ?? 0));  // the most influential first
      members.forEach((n, i) => {
        const line = Math.floor(i / perLine), k = i % perLine, inLine = Math.min(perLine, members.length - line * perLine);
        at.set(n.id, {x: LEFT + col * colW + colW / 2 + (k - (inLine - 1) / 2) * STEP,
          y: rowTop.get(row) + rowH.get(row) - 12 - line * STEP});
      });
    }
    return {at, nCols, colW, allRows, rowH, rowTop, maxRow, width: LEFT + nCols * colW + 10, height};
  }

  function rowName(row, maxRow, data) {
    if (row === 0) return "tokens";
    if (row === maxRow && data.nodes.some((n) => n.type === "logit" && n.row === row)) return "logits";
    return `layer ${row - 1}`;
  }

  function nodeLabel(n, tokens) {
    if (n.type === "embedding") return `token ${n.ctx} ${JSON.stringify(tokens[n.ctx] ?? "")}`;
    return n.clerp || n.id;
  }

  // The rows' lines and names, and the prompt's tokens under their columns (drawn once).
  function gridLayer(data, L) {
    const tokens = data.metadata.prompt_tokens;
    const grid = svg("g", {class: "graph-grid"});
    for (const r of L.allRows) {
      const y = L.rowTop.get(r);
      grid.append(svg("line", {x1: LEFT - 4, x2: L.width - 10, y1: y + L.rowH.get(r), y2: y + L.rowH.get(r),
        class: "grid"}));
      grid.append(svg("text", {x: 4, y: y + L.rowH.get(r) / 2 + 4, class: "row-label"}, rowName(r, L.maxRow, data)));
    }
    const maxChars = Math.max(3, Math.floor(L.colW / 7));
    tokens.forEach((t, k) => {
      const shownText = t.length > maxChars ? t.slice(0, maxChars - 1) + "…" : t;
      const label = svg("text", {x: LEFT + k * L.colW + L.colW / 2, y: L.height - BOTTOM + 16, "text-anchor": "middle",
        class: "col-label", "data-index": k}, shownText);
      label.append(svg("title", {}, `token ${k}: ${t}`));
      grid.append(label, svg("text", {x: LEFT + k * L.colW + L.colW / 2, y: L.height - BOTTOM + 30,
        "text-anchor": "middle", class: "col-index"}, k));
    });
    return grid;
  }

  // The links shown: width by |weight| (relative to the largest), colour by sign; the selected node's highlighted.
  function linkLayer(shown, L, sel, maxAbs) {
    const links = svg("g", {class: "graph-links"});
    for (const l of [...shown.links].reverse()) {  // the largest drawn last, on top
      const a = L.at.get(l.source), b = L.at.get(l.target);
      const on = sel && (l.source === sel || l.target === sel);
      links.append(svg("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: "link" + (on ? " hl" : sel ? " dim" : ""),
        stroke: l.weight >= 0 ? COLORS.positive : COLORS.negative,
        "stroke-width": (0.4 + 3.6 * Math.abs(l.weight) / maxAbs).toFixed(2),
        "data-source": l.source, "data-target": l.target, "data-weight": l.weight}));
    }
    return links;
  }

  // The nodes shown: a square per token, a circle per neuron, a diamond per logit, a triangle per bias node (an
  // affine family's constants of a layer at a position); a click calls onClick(id).
  function nodeLayer(data, shown, L, sel, onClick) {
    const tokens = data.metadata.prompt_tokens;
    const nodes = svg("g", {class: "graph-nodes"});
    for (const n of data.nodes) {
      if (!shown.nodes.has(n.id)) continue;
      const {x, y} = L.at.get(n.id);
      const shape = n.type === "embedding" ? svg("rect", {x: x - 5, y: y - 5, width: 10, height: 10})
        : n.type === "logit" ? svg("path", {d: `M${x} ${y - 6}L${x + 6} ${y}L${x} ${y + 6}L${x - 6} ${y}Z`})
          : n.type === "bias" ? svg("polygon", {points: `${x},${y - 5} ${x + 5},${y + 4} ${x - 5},${y + 4}`})
            : svg("circle", {cx: x, cy: y, r: 4.5});
      const g = svg("g", {class: `node node-${n.type === "mlp neuron" ? "neuron" : n.type}` +
        (n.id === sel ? " selected" : ""), "data-id": n.id, tabindex: 0});
      g.append(shape, svg("title", {}, `${nodeLabel(n, tokens)} (${n.id})`));
      g.addEventListener("click", () => onClick(n.id));
      nodes.append(g);
    }
    return nodes;
  }

  function render(data) {
    const tokens = data.metadata.prompt_tokens;
    const byId = new Map(data.nodes.map((n) => [n.id, n]));
    const L = layout(data);
    const maxAbs = Math.max(1e-300, ...data.links.map((l) => Math.abs(l.weight)));
    const nNeurons = data.nodes.filter(isNeuron).length;
    const state = {nodeT: 1, edgeT: 1, selected: null};

    const graphSvg = svg("svg", {id: "graph-svg", class: "graph", width: L.width, height: L.height,
      viewBox: `0 0 ${L.width} ${L.height}`, role: "img", "aria-label": "attribution graph"});
    const details = h("div", {id: "node-details"}, h("p", {class: "note"}, "Click a node for its labels and edges."));
    const count = h("span", {class: "note", id: "graph-count"});
    const slider = (id, label, value) => {
      const input = h("input", {type: "range", id, min: "0.01", max: "1", step: "0.01", value: String(value),
        "aria-label": label});
      const shown = h("output", {for: id, id: `${id}-value`}, Number(value).toFixed(2));
      return {input, shown, el: h("label", {class: "slider"}, label, " ", input, " ", shown)};
    };
    const nodeSlider = slider("node-threshold", "nodes: influence ≤", state.nodeT);
    const edgeSlider = slider("edge-threshold", "links: cumulative |weight| share ≤", state.edgeT);

    const grid = gridLayer(data, L);

    function draw() {
      const shown = visible(data, state.nodeT, state.edgeT);
      const sel = state.selected && shown.nodes.has(state.selected) ? state.selected : null;
      state.selected = sel;
      graphSvg.replaceChildren(grid, linkLayer(shown, L, sel, maxAbs),
        nodeLayer(data, shown, L, sel, (id) => select(id)));
      count.textContent = `shown: ${shown.nodes.size - (data.nodes.length - nNeurons)} of ${nNeurons} neurons ` +
        `(${shown.nodes.size} of ${data.nodes.length} nodes), ${shown.links.length} of ${data.links.length} links`;
      showDetails(sel, shown);
    }

    function edgeTable(id, title, edges, end) {
      return h("div", {}, h("h3", {}, `${title} (${edges.length})`),
        h("table", {id, class: "edges"}, h("thead", {}, h("tr", {}, ["node", "label", "weight"].map((t) => h("th", {}, t)))),
          h("tbody", {}, edges.map((l) => {
            const other = byId.get(l[end]);
            return h("tr", {class: "clickable", "data-id": other.id, onclick: () => select(other.id)},
              h("td", {class: "mono"}, other.id), h("td", {class: "text"}, nodeLabel(other, tokens)),
              h("td", {class: "num " + (l.weight >= 0 ? "positive" : "negative")}, num(l.weight)));
          }))));
    }

    function showDetails(id, shown) {
      if (id === null) {
        details.replaceChildren(h("p", {class: "note"}, "Click a node for its labels and edges."));
        return;
      }
      const n = byId.get(id);
      const order = (a, b) => Math.abs(b.weight) - Math.abs(a.weight);
      const incoming = shown.links.filter((l) => l.target === id).sort(order);
      const outgoing = shown.links.filter((l) => l.source === id).sort(order);
      const all = data.links.filter((l) => l.target === id || l.source === id).length;
      const layer = n.type === "embedding" ? "tokens" : n.type === "logit" ? "logits" : `layer ${n.layer}`;
      details.replaceChildren(...[
        h("h3", {id: "node-label", class: "text"}, nodeLabel(n, tokens)),
        h("dl", {class: "facts", id: "node-facts"}, [["node", n.id], ["type", n.type], ["layer", layer],
          ["position", `${n.ctx} ${JSON.stringify(tokens[n.ctx] ?? "")}`], ["activation", n.activation == null ? null : num(n.activation, 6)],
          ["influence", n.influence == null ? null : num(n.influence, 4)], ["probability", n.p == null ? null : num(n.p, 4)],
          ["label (clerp)", n.clerp || null]].filter(([, v]) => v != null)
          .map(([k, v]) => [h("dt", {}, k), h("dd", {"data-fact": k}, String(v))])),
        all > incoming.length + outgoing.length
          ? h("p", {class: "note"}, `${all - incoming.length - outgoing.length} more edges hidden by the thresholds`) : null,
        h("div", {class: "row"}, edgeTable("incoming", "Incoming edges", incoming, "source"),
          edgeTable("outgoing", "Outgoing edges", outgoing, "target"))].filter(Boolean));
    }

    function select(id) {
      state.selected = state.selected === id ? null : id;
      draw();
    }

    for (const [s, key] of [[nodeSlider, "nodeT"], [edgeSlider, "edgeT"]]) {
      s.input.addEventListener("input", () => {
        state[key] = Number(s.input.value);
        s.shown.textContent = state[key].toFixed(2);
        draw();
      });
    }
    draw();
    const info = data.metadata.info;
    const facts = [["model", info.model], ["family", info.family], ["dtype", info.dtype],
      ["exact", info.exact == null ? null : String(info.exact)], ["error nodes", info.error_nodes],
      ["completeness", info.completeness == null ? null : Number(info.completeness).toExponential(1)],
      ["node threshold (pruned at)", data.metadata.node_threshold], ["edge threshold (pruned at)", info.edge_threshold],
      ["nodes before pruning", info.nodes_before_pruning]].filter(([, v]) => v != null);
    const legend = h("div", {class: "legend"}, [["positive", COLORS.positive], ["negative", COLORS.negative]]
      .map(([t, c]) => { const sw = h("i"); sw.style.background = c; return h("span", {}, sw, `${t} weight`); }),
    h("span", {}, "width ∝ |weight| · ■ token · ● neuron · ◆ logit"));
    return h("div", {class: "graph-page"},
      h("div", {class: "facts-inline", id: "graph-facts"}, facts.map(([k, v]) =>
        h("span", {}, h("span", {class: "note"}, k), " ", String(v)))),
      h("div", {class: "controls"}, nodeSlider.el, edgeSlider.el, count),
      legend,
      h("div", {class: "graph-scroll"}, graphSvg),
      h("section", {class: "panel"}, details));
  }

  return {render, visible};
})();
