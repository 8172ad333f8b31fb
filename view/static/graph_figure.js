// detjac view: a figure of a graph. Pin nodes (shift-click a node, or press P with a node selected or focused; the
// pinned list shows them), keep the subgraph of the pinned nodes and the links among them, group pinned neurons by
// hand into a named supernode drawn as one node, save that state as a new graph JSON file (qParams.pinnedIds and
// qParams.supernodes, as circuit-tracer and Neuronpedia write them) and export the subgraph as a labelled SVG. Both
// are files the browser downloads: nothing is sent to detjac view, the file shown is never written. Every label is
// set as text (textContent, and XMLSerializer escapes it in the SVG file), never as markup.
"use strict";

const GraphFigure = (() => {
  const {svg, h} = Dom;
  const COLORS = {positive: "#2a62b8", negative: "#d0543e"};
  const PREFIX = "G_";  // a group's node id (detjac/view/graph_groups.py)
  const states = new WeakMap();  // per graph page: kept while the page is drawn again (a new group redraws it)

  // The figure's state of `graph` (its payload): `pinned` (node ids, in pinning order; from the file's
  // qParams.pinnedIds), `subgraph` (whether only the pinned nodes are drawn), `hand` ([name, member ids] made here).
  function state(graph) {
    if (!states.has(graph)) states.set(graph, {pinned: new Set(graph.pinned || []), subgraph: false, hand: [],
      note: ""});
    return states.get(graph);
  }

  // The sum of `values`, compensated (Neumaier): a group's links are drawn from their members' sums, close to the
  // correctly rounded sums the server computes for the groups a file carries (math.fsum).
  function sum(values) {
    let s = 0, c = 0;
    for (const v of values) {
      const t = s + v;
      c += Math.abs(s) >= Math.abs(v) ? (s - t) + v : (v - t) + s;
      s = t;
    }
    return s + c;
  }

  // Why `members` cannot make a group (null when they can): the rule the server applies to a file's supernodes
  // (detjac/view/graph_groups.py, parse_supernodes): two or more neurons of one layer, none already in a group.
  function refusal(members, byId, groupOf) {
    if (members.length < 2) return `Expected two or more pinned neurons ticked for a group. Got ${members.length}.`;
    const other = members.find((m) => byId.get(m).type !== NODE_KIND.NEURON);
    if (other) return `Expected neurons only in a group. Got ${byId.get(other).type} ${other}.`;
    const layers = [...new Set(members.map((m) => byId.get(m).layer))];
    if (layers.length > 1) {
      return `Expected neurons of one layer (a layer's neurons never feed each other: the group's links then sum ` +
        `exactly to its value). Got layers ${layers.join(", ")}.`;
    }
    const again = members.find((m) => groupOf.has(m));
    return again ? `Expected neurons in no other group. Got ${again}, already in one.` : null;
  }

  // `graph` with the groups made by hand added to its own (`groups`: nodes and summed links, as the server writes
  // them: detjac/view/graph_groups.py, group_nodes and group_links), or `graph` itself when there are none.
  function withHand(graph, fig) {
    if (!fig.hand.length) return graph;
    const own = graph.groups || {nodes: [], links: [], skipped: [], meaning: "A group made here is drawn as one " +
      "node: its value is its members' sum and its links their links' sums. Save the figure to keep it."};
    const byId = new Map(graph.nodes.map((n) => [n.id, n]));
    const made = fig.hand.map(([name, members], k) => {
      const rows = members.map((m) => byId.get(m));
      const first = rows.reduce((a, b) => ((b.influence ?? Infinity) < (a.influence ?? Infinity) ? b : a));
      const values = rows.map((n) => n.activation);
      return {id: `${PREFIX}${own.nodes.length + k}`, type: "group", layer: first.layer, row: first.row,
        ctx: first.ctx, activation: values.includes(null) ? null : sum(values), influence: first.influence,
        clerp: `${name} (${members.length} neurons)`, name, p: null, token: null, drivers: null, members,
        size: members.length};
    });
    const of = new Map([...own.nodes, ...made].flatMap((g) => g.members.map((m) => [m, g.id])));
    const isMade = new Set(made.map((g) => g.id));
    const sums = new Map();
    for (const l of graph.links) {  // the links an end made by hand can need: the server's rule, for these ends
      const gs = of.get(l.source), gt = of.get(l.target);
      const ends = [...(gs ? [[gs, l.target]] : []), ...(gt ? [[l.source, gt]] : []), ...(gs && gt ? [[gs, gt]] : [])];
      for (const [s, t] of ends) {
        if (!isMade.has(s) && !isMade.has(t)) continue;  // the server's own
        const key = JSON.stringify([s, t]);
        if (!sums.has(key)) sums.set(key, {source: s, target: t, weights: []});
        sums.get(key).weights.push(l.weight);
      }
    }
    const links = [...sums.values()].map((x) => ({source: x.source, target: x.target, weight: sum(x.weights),
      parts: x.weights.length}));
    return {...graph, groups: {...own, nodes: [...own.nodes, ...made], links: [...own.links, ...links]}};
  }

  // The nodes drawn in the subgraph: the pinned ones drawn (a collapsed group in place of its pinned members), and
  // every link among them (whatever the sliders keep).
  function subgraph(data, fig, off, groupOf) {
    const nodes = new Set();
    for (const id of fig.pinned) {
      const g = groupOf.get(id);
      nodes.add(off.has(id) && g && !off.has(g) ? g : id);
    }
    for (const id of [...nodes]) if (off.has(id)) nodes.delete(id);
    return {nodes, links: data.links.filter((l) => nodes.has(l.source) && nodes.has(l.target))
      .sort((a, b) => Math.abs(b.weight) - Math.abs(a.weight))};
  }

  function isPinned(fig, n) {
    return fig.pinned.has(n.id) || (n.members != null && n.members.some((m) => fig.pinned.has(m)));
  }

  function download(name, text, type) {
    const url = URL.createObjectURL(new Blob([text], {type}));
    const a = h("a", {href: url, download: name, hidden: true});
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  const fileStem = (graph) => String(graph.metadata.slug || "graph").replace(/[^\w.-]+/g, "_").slice(0, 80);

  // The graph as the page holds it (`graph`: with the groups made here, withHand), with the figure in its qParams: every node and link (ids, kinds, layers,
  // positions, values, labels, weights) and the metadata the page shows. Not the head loadings (the page keeps
  // each layer's largest only): the original file keeps them.
  function graphJson(graph, fig, clicked) {
    const m = graph.metadata;
    const groups = graph.groups ? graph.groups.nodes.map((g) => [g.name, ...g.members]) : [];  // with those made here
    return {
      metadata: {slug: m.slug, scan: m.info.model ?? null, prompt: m.prompt, prompt_tokens: m.prompt_tokens,
        node_threshold: m.node_threshold, schema_version: 1, info: m.info},
      qParams: {pinnedIds: [...fig.pinned], supernodes: groups, linkType: "both", clickedId: clicked || "",
        sg_pos: ""},
      nodes: graph.nodes.map((n) => ({node_id: n.id, feature_type: n.type, layer: n.layer, ctx_idx: n.ctx,
        activation: n.activation, influence: n.influence, clerp: n.clerp,
        ...(n.p == null ? {} : {token_prob: n.p})})),
      links: graph.links.map((l) => ({source: l.source, target: l.target, weight: l.weight})),
    };
  }

  // The subgraph as a standalone SVG (XMLSerializer declares its namespace): the pinned nodes by layer (rows) and position (columns), each labelled, the
  // links among them coloured by their weight's sign, as wide as |weight|, each with its weight as its title.
  function figureSvg(data, sub, label) {
    const nodes = data.nodes.filter((n) => sub.nodes.has(n.id));
    const rows = [...new Set(nodes.map((n) => n.row))].sort((a, b) => b - a);  // the logits on top
    const cols = [...new Set(nodes.map((n) => n.ctx))].sort((a, b) => a - b);
    const COL = 260, STEP = 20, LEFT = 90, TOP = 30;
    const cell = new Map();
    for (const n of nodes) {
      const key = `${n.row}/${n.ctx}`;
      cell.set(key, [...(cell.get(key) || []), n]);
    }
    const rowH = new Map(rows.map((r) => [r, STEP * Math.max(1, ...cols.map((c) => (cell.get(`${r}/${c}`) || [])
      .length)) + 24]));
    const rowTop = new Map();
    let y = TOP;
    for (const r of rows) { rowTop.set(r, y); y += rowH.get(r); }
    const at = new Map();
    for (const [key, members] of cell) {
      const [r, c] = key.split("/").map(Number);
      members.forEach((n, i) => at.set(n.id, {x: LEFT + cols.indexOf(c) * COL + 12, y: rowTop.get(r) + 14 + i * STEP}));
    }
    const width = LEFT + cols.length * COL + 20, height = y + 40;
    const out = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`,
      "font-family": "sans-serif", "font-size": 11});
    out.append(svg("rect", {x: 0, y: 0, width, height, fill: "white"}));
    for (const r of rows) {
      out.append(svg("text", {x: 6, y: rowTop.get(r) + 18, fill: "#555", class: "row-label"},
        GraphLayout.rowName(r, Math.max(...data.nodes.map((n) => n.row)), data)));
    }
    cols.forEach((c, i) => out.append(svg("text", {x: LEFT + i * COL + 12, y: height - 14, fill: "#555",
      class: "col-label"}, `${c} ${JSON.stringify(data.metadata.prompt_tokens[c] ?? "")}`)));
    const max = Math.max(1e-300, ...sub.links.map((l) => Math.abs(l.weight)));
    for (const l of [...sub.links].reverse()) {  // the largest drawn last, on top
      const a = at.get(l.source), b = at.get(l.target);
      const line = svg("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: "link",
        stroke: l.weight >= 0 ? COLORS.positive : COLORS.negative, "stroke-opacity": 0.8,
        "stroke-width": (0.5 + 4.5 * Math.abs(l.weight) / max).toFixed(2), "data-weight": l.weight});
      line.append(svg("title", {}, `${l.source} → ${l.target}: ${l.weight}`));
      out.append(line);
    }
    for (const n of nodes) {
      const {x, y: ny} = at.get(n.id);
      const g = svg("g", {class: "node", "data-id": n.id});
      g.append(svg("circle", {cx: x, cy: ny, r: 5, fill: n.type === "logit" ? "#333" : "#fff", stroke: "#333"}),
        svg("text", {x: x + 9, y: ny + 4, class: "node-label"}, label(n)));
      out.append(g);
    }
    return out;
  }

  // The figure's panel: the pinned nodes (each with a box to tick for a group, and a button to unpin), the subgraph
  // switch, a group's name and button, save and export. `act` is the graph page's: {redraw, rebuild, selected}.
  function panel(ctx, graph, fig, act) {
    const label = (n) => GraphPanels.nodeLabel(n, ctx.tokens);
    const pinned = [...fig.pinned].filter((id) => ctx.byId.has(id));
    const note = h("p", {class: "note", id: "figure-note"}, fig.note);
    const say = (text) => { fig.note = text; note.textContent = text; };
    const list = h("ul", {id: "pinned-list", class: "pinned-list"}, pinned.map((id) => h("li", {"data-id": id},
      h("input", {type: "checkbox", class: "pin-pick", "data-id": id, "aria-label": `tick ${id} for a group`}), " ",
      h("span", {class: "mono"}, id), " ", h("span", {class: "text"}, label(ctx.byId.get(id))), " ",
      h("button", {type: "button", class: "unpin", onclick: () => act.pin(id)}, "unpin"))));
    const only = h("input", {type: "checkbox", id: "subgraph-only", checked: fig.subgraph});
    only.addEventListener("change", () => { fig.subgraph = only.checked; act.redraw(); });
    const name = h("input", {type: "text", id: "supernode-name", placeholder: "group name", "aria-label": "group name"});
    const group = () => {
      const members = [...list.querySelectorAll(".pin-pick:checked")].map((b) => b.dataset.id);
      const why = refusal(members, ctx.byId, act.groupOf);
      if (why) return say(why);
      const given = name.value.trim();
      fig.hand.push([given || `group ${fig.hand.length + 1}`, members]);
      fig.note = `Grouped ${members.length} neurons as ${JSON.stringify(given || `group ${fig.hand.length}`)}.`;
      return act.rebuild();
    };
    const save = () => {
      const file = `${fileStem(graph)}.figure.json`;
      download(file, JSON.stringify(graphJson(act.graph(), fig, act.selected())), "application/json");
      say(`Saved ${file}: a new graph JSON with ${fig.pinned.size} pinned nodes and its supernodes in qParams (your ` +
        "browser's downloads); the file shown is unchanged. Open it with detjac view to find the figure again.");
    };
    const exportSvg = () => {
      const sub = act.subgraph();
      if (!sub.nodes.size) return say("Expected pinned nodes for a figure. Got none: pin nodes first.");
      const file = `${fileStem(graph)}.figure.svg`;
      const text = new XMLSerializer().serializeToString(figureSvg(act.data(), sub, label));
      download(file, `<?xml version="1.0" encoding="UTF-8"?>\n${text}\n`, "image/svg+xml");
      return say(`Exported ${file}: ${sub.nodes.size} nodes and ${sub.links.length} links, labelled.`);
    };
    return h("div", {class: "figure-panel", id: "figure-panel"},
      h("div", {class: "controls"}, h("strong", {}, `Pinned (${pinned.length})`),
        h("span", {class: "note"}, "shift-click a node, or press P with one selected, to pin or unpin it"),
        h("label", {}, only, " only the pinned nodes and their links"),
        h("button", {type: "button", id: "pin-selected", onclick: () => act.selected() && act.pin(act.selected())},
          "pin / unpin the selected node")),
      list,
      h("div", {class: "controls"}, name, h("button", {type: "button", id: "supernode-make", onclick: group},
        "group the ticked neurons"),
      h("button", {type: "button", id: "figure-save", onclick: save}, "save as a new graph JSON"),
      h("button", {type: "button", id: "figure-svg", onclick: exportSvg}, "export the pinned subgraph as SVG")),
      note);
  }

  // P pins or unpins the node focused (a node of the drawing) or else the selected one, while `page` is shown.
  function keys(page, act) {
    const onKey = (e) => {
      if (!page.isConnected) { document.removeEventListener("keydown", onKey); return; }
      if (e.key !== "p" && e.key !== "P") return;
      if (e.target.closest && e.target.closest("input, textarea, select")) return;
      const focused = e.target.closest && e.target.closest("g.node");
      const id = focused ? focused.dataset.id : act.selected();
      if (id) act.pin(id);
    };
    document.addEventListener("keydown", onKey);
  }

  return {state, withHand, subgraph, isPinned, panel, keys, graphJson, figureSvg};
})();
