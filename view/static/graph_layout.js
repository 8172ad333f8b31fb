// detjac view: where the graph page draws each node (rows are layers, the prompt's tokens at the bottom and the logits at
// the top; columns are the prompt's positions, as wide as the window allows), and what its filters keep.
"use strict";

// The node kinds (the JSON's feature_type), as detjac.graph_nodes declares them: the one place the viewer's files
// name them (tests/view/test_graph_kinds.py holds the two lists equal).
const NODE_KIND = Object.freeze({NEURON: "mlp neuron", TOKEN: "embedding", LOGIT: "logit", BIAS: "bias",
  HEAD: "attention head", MLP: "mlp", CONSTANT: "constant"});

const GraphLayout = (() => {
  const STEP = 13;  // pixels between two nodes of one cell
  const LEFT = 78, RIGHT = 10, BOTTOM = 40, TOP_PLAIN = 14, TOP_LOGITS = 96;  // room for the logits' slanted labels
  const MIN_COL = 44;  // a column narrower than this scrolls sideways instead

  const isNeuron = (n) => n.type !== NODE_KIND.TOKEN && n.type !== NODE_KIND.LOGIT;

  // What the filters keep. Nodes: tokens and logits always; a neuron (or bias node) while its influence (the
  // cumulative share of influence down to it, as `detjac graph` writes it) is at most `nodeT` and its position is not
  // among `hidden`. Links between kept nodes, largest |weight| first, while the |weight| taken before them is below
  // `edgeT` of their total (1: every link). The nodes of `off` (ids: the members of a collapsed group, an expanded
  // group) are never kept.
  function visible(data, nodeT, edgeT, hidden, off) {
    const nodes = new Set(data.nodes.filter((n) => !(off && off.has(n.id)) && (!isNeuron(n) ||
      ((n.influence == null || n.influence <= nodeT + 1e-12) && !(hidden && hidden.has(n.ctx))))).map((n) => n.id));
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

  // Positions of every node in a box of `width` x `height` pixels (the window's share; recomputed when it changes):
  // a cell per (row, position), its nodes in lines across the column's width; rows share out the height left over.
  function layout(data, width, height) {
    const tokens = data.metadata.prompt_tokens;
    const nCols = data.nodes.reduce((m, n) => Math.max(m, n.ctx + 1), Math.max(1, tokens.length));
    const rows = [...new Set(data.nodes.map((n) => n.row))].sort((a, b) => a - b);
    const maxRow = rows.length ? rows[rows.length - 1] : 0;
    const hasLogits = data.nodes.some((n) => n.type === NODE_KIND.LOGIT);
    const top = hasLogits ? TOP_LOGITS : TOP_PLAIN;
    const cells = new Map();
    for (const n of data.nodes) {
      const key = `${n.row}/${n.ctx}`;
      if (!cells.has(key)) cells.set(key, []);
      cells.get(key).push(n);
    }
    const colW = Math.max(MIN_COL, (width - LEFT - RIGHT) / nCols);
    const perLine = Math.max(2, Math.floor((colW - 12) / STEP));
    const lines = (row) => Math.max(1, ...Array.from({length: nCols}, (_, c) =>
      Math.ceil((cells.get(`${row}/${c}`) || []).filter((n) => n.type !== NODE_KIND.LOGIT).length / perLine)));
    const allRows = Array.from({length: maxRow + 1}, (_, r) => r);  // every layer, empty ones too
    const rowH = new Map(allRows.map((r) => [r, Math.max(34, lines(r) * STEP + 18)]));
    const natural = top + allRows.reduce((s, r) => s + rowH.get(r), 0) + BOTTOM;
    const extra = Math.max(0, height - natural) / allRows.length;  // fill the box's height too
    for (const r of allRows) rowH.set(r, rowH.get(r) + extra);
    const fullHeight = Math.max(natural, height);
    const rowTop = new Map();
    let y = fullHeight - BOTTOM;
    for (const r of allRows) { y -= rowH.get(r); rowTop.set(r, y); }
    const at = new Map();
    for (const [key, members] of cells) {
      const [row, col] = key.split("/").map(Number);
      const centre = LEFT + col * colW + colW / 2;
      const logits = members.filter((n) => n.type === NODE_KIND.LOGIT);  // one line, most probable first, room for labels
      logits.sort((a, b) => (b.p ?? 0) - (a.p ?? 0));
      const gap = Math.min(30, (colW - 8) / Math.max(1, logits.length));
      logits.forEach((n, i) => at.set(n.id, {x: centre + (i - (logits.length - 1) / 2) * gap,
        y: rowTop.get(row) + rowH.get(row) - 14}));
      const rest = members.filter((n) => n.type !== NODE_KIND.LOGIT);
      rest.sort((a, b) => (a.influence ?? 0) - (b.influence ?? 0));  // the most influential first
      const nLines = Math.ceil(rest.length / perLine);  // lines spread out where the row has room (up to 3 steps)
      const lineGap = Math.max(STEP, Math.min(3 * STEP, (rowH.get(row) - 24) / Math.max(1, nLines)));
      rest.forEach((n, i) => {
        const line = Math.floor(i / perLine), k = i % perLine, inLine = Math.min(perLine, rest.length - line * perLine);
        at.set(n.id, {x: centre + (k - (inLine - 1) / 2) * STEP, y: rowTop.get(row) + rowH.get(row) - 12 - line * lineGap});
      });
    }
    return {at, nCols, colW, allRows, rowH, rowTop, maxRow, left: LEFT, bottom: BOTTOM,
      width: LEFT + nCols * colW + RIGHT, height: fullHeight};
  }

  function rowName(row, maxRow, data) {
    if (row === 0) return "tokens";
    if (row === maxRow && data.nodes.some((n) => n.type === NODE_KIND.LOGIT && n.row === row)) return "logits";
    return `layer ${row - 1}`;
  }

  return {layout, visible, rowName, isNeuron};
})();
