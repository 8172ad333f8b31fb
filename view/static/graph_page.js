// detjac view: an attribution graph (circuit-tracer's graph JSON as `detjac graph` writes it), drawn by hand in SVG.
// Rows are layers (the prompt's tokens at the bottom, the logits at the top, labelled with their tokens), columns the
// prompt's positions, across the window's width; a link's width is its |weight|, its colour its sign. A click on a
// logit or a node shows what drives it (its drivers kept, the rest faded), its labels and edges; the sliders and the
// position filter hide nodes and links; a group (supernode) is one node until a click expands it (graph_groups.js);
// pinned nodes, their subgraph, groups made by hand, a saved graph JSON and an SVG figure: graph_figure.js.
// Every label (token texts, clerps, group names) is set with textContent only.
"use strict";

const GraphPage = (() => {
  const COLORS = {positive: "#2a62b8", negative: "#d0543e"};
  const MAX_FADED = 20000;  // more links shown than this: a selection fades them as one group (redrawn: seconds)
  const {svg, h} = GraphPanels;
  const {layout, visible, rowName, isNeuron} = GraphLayout;

  // The rows' lines and names, and the prompt's tokens under their columns.
  function gridLayer(data, L) {
    const tokens = data.metadata.prompt_tokens;
    const grid = document.createDocumentFragment();
    for (const r of L.allRows) {
      const y = L.rowTop.get(r);
      grid.append(svg("line", {x1: L.left - 4, x2: L.width - 10, y1: y + L.rowH.get(r), y2: y + L.rowH.get(r),
        class: "grid"}));
      grid.append(svg("text", {x: 4, y: y + L.rowH.get(r) / 2 + 4, class: "row-label"}, rowName(r, L.maxRow, data)));
    }
    const maxChars = Math.max(3, Math.floor(L.colW / 7));
    tokens.forEach((t, k) => {
      const shownText = t.length > maxChars ? t.slice(0, maxChars - 1) + "…" : t;
      const x = L.left + k * L.colW + L.colW / 2;
      const label = svg("text", {x, y: L.height - L.bottom + 16, "text-anchor": "middle", class: "col-label",
        "data-index": k}, shownText);
      label.append(svg("title", {}, `token ${k}: ${t}`));
      grid.append(label, svg("text", {x, y: L.height - L.bottom + 30, "text-anchor": "middle", class: "col-index"}, k));
    });
    return grid;
  }

  // The links shown: width by |weight| (relative to the largest), colour by sign. With a node selected: the links among
  // it and its drivers drawn, its own highlighted (hl), the others among them plain (path), the rest faded (dim); a
  // node without drivers (a token) has all its own edges highlighted.
  function linkLayer(shown, L, sel, focus, maxAbs, picked) {
    const links = document.createDocumentFragment();
    const skipFaded = sel && shown.links.length > MAX_FADED;
    for (let i = shown.links.length - 1; i >= 0; i--) {  // the largest drawn last, on top
      const l = shown.links[i];
      const path = focus && focus.has(l.source) && focus.has(l.target);
      const own = sel && (l.source === sel || l.target === sel) && (!focus || path);
      if (skipFaded && !own && !path && l !== picked) continue;
      const a = L.at.get(l.source), b = L.at.get(l.target);
      links.append(svg("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y,
        class: "link" + (own ? " hl" : path ? " path" : sel ? " dim" : "") + (l === picked ? " picked" : "") +
          (l.heads ? " loaded" : ""),
        stroke: l.weight >= 0 ? COLORS.positive : COLORS.negative,
        "stroke-width": (0.4 + 3.6 * Math.abs(l.weight) / maxAbs).toFixed(2),
        "data-source": l.source, "data-target": l.target, "data-weight": l.weight, "data-index": l.index}));
    }
    return links;
  }

  // The nodes shown: a square per token, a circle per neuron, a diamond per logit (labelled with its token and
  // probability), a triangle per bias node; with a selection, the nodes outside it and its drivers faded.
  function nodeLayer(ctx, shown, L, sel, focus) {
    const nodes = document.createDocumentFragment();
    for (const n of ctx.data.nodes) {
      if (!shown.nodes.has(n.id)) continue;
      const {x, y} = L.at.get(n.id);
      const shape = n.type === "group" ? GraphGroups.shape(n, x, y)
        : n.type === NODE_KIND.TOKEN ? svg("rect", {x: x - 5, y: y - 5, width: 10, height: 10})
        : n.type === NODE_KIND.LOGIT ? svg("path", {d: `M${x} ${y - 6}L${x + 6} ${y}L${x} ${y + 6}L${x - 6} ${y}Z`})
          : n.type === NODE_KIND.BIAS ? svg("polygon", {points: `${x},${y - 5} ${x + 5},${y + 4} ${x - 5},${y + 4}`})
            : svg("circle", {cx: x, cy: y, r: 4.5});
      const faded = (sel && !(focus ? focus.has(n.id) : n.id === sel)) || (ctx.highlit.size && !ctx.highlit.has(n.id));
      const g = svg("g", {class: `node node-${n.type === NODE_KIND.NEURON ? "neuron" : n.type}` +
        (n.id === sel ? " selected" : focus && focus.has(n.id) ? " driver" : "") + (faded ? " faded" : "") +
        (ctx.highlit.has(n.id) ? " highlit" : "") + (ctx.pinned(n) ? " pinned" : ""),
      "data-id": n.id, "data-activation": n.activation, tabindex: 0});  // its sign: which side its page leads with
      g.append(...[shape].flat(), svg("title", {}, `${GraphPanels.nodeLabel(n, ctx.tokens)} (${n.id})`));
      if (n.type === NODE_KIND.LOGIT) {
        const text = n.token ?? n.clerp;
        const short = text.length > 14 ? text.slice(0, 13) + "…" : text;
        g.append(svg("text", {x: x + 2, y: y - 9, class: "logit-label", "text-anchor": "end",  // up and to the left
          transform: `rotate(40 ${x + 2} ${y - 9})`},
          `${JSON.stringify(short)} ${n.p == null ? "" : n.p.toFixed(2)}`));
      }
      g.addEventListener("click", (e) => (e.shiftKey ? ctx.pin(n.id)  // shift: pinned (graph_figure.js)
        : n.type === "group" ? ctx.toggleGroup(n.id) : ctx.select(n.id)));
      nodes.append(g);
    }
    return nodes;
  }

  // Draw `data` into `container` (replacing what it holds), at the width the window gives it; redrawn on resize.
  // `opts.select`: a node to select first; `opts.highlight` (`{ids, text}`): nodes to ring, the rest faded, with a
  // line saying what they are (what an attention page's component names on the graph).
  function show(container, graph, opts = {}) {
    const fig = GraphFigure.state(graph);  // pins and groups made by hand, kept while the page is drawn again
    const grouped = GraphFigure.withHand(graph, fig);
    const {all: data, state: groups} = GraphGroups.attach(grouped);  // its groups' nodes and links appended
    const tokens = data.metadata.prompt_tokens;
    const byId = new Map(data.nodes.map((n) => [n.id, n]));
    const maxAbs = data.links.reduce((m, l) => Math.max(m, Math.abs(l.weight)), 1e-300);  // no spread: 10⁶ links
    const nNeurons = graph.nodes.filter(isNeuron).length;
    data.links.forEach((l, i) => { l.index = i; });
    const highlight = opts.highlight || null;
    const state = {nodeT: 1, edgeT: 1, selected: byId.has(opts.select) ? opts.select : null, hidden: new Set(),
      link: null};
    groups.open([state.selected, ...(highlight ? highlight.ids : [])]);  // what is asked for is drawn
    const ctx = {data, tokens, byId, select, pickLink, toggleGroup, pin, pinned: (n) => GraphFigure.isPinned(fig, n),
      off: groups.off(),
      highlit: new Set(highlight ? highlight.ids : []), hidden: (n) => isNeuron(n) && state.hidden.has(n.ctx),
      selected: () => state.selected};

    const graphSvg = svg("svg", {id: "graph-svg", class: "graph", role: "img", "aria-label": "attribution graph"});
    const scroll = h("div", {class: "graph-scroll"}, graphSvg);
    const details = h("div", {id: "node-details"});
    const linkDetails = h("div", {id: "link-details"});
    graphSvg.addEventListener("click", (e) => {  // one listener for every link (a million of them, at most)
      if (e.target.classList && e.target.classList.contains("link")) pickLink(data.links[Number(e.target.dataset.index)]);
    });
    const focusNote = h("p", {class: "note", id: "focus-note"});
    const count = h("span", {class: "note", id: "graph-count"});
    const slider = (id, label, value) => {
      const input = h("input", {type: "range", id, min: "0.01", max: "1", step: "0.01", value: String(value),
        "aria-label": label});
      const shown = h("output", {for: id, id: `${id}-value`}, Number(value).toFixed(2));
      return {input, shown, el: h("label", {class: "slider"}, label, " ", input, " ", shown)};
    };
    const nodeSlider = slider("node-threshold", "nodes: influence ≤", state.nodeT);
    const edgeSlider = slider("edge-threshold", "links: cumulative |weight| share ≤", state.edgeT);
    // Layers kept between draws: a big graph's links (over MAX_FADED) are drawn once per filter or size and faded as
    // one group while a node is selected, its drivers' links drawn over them: a selection costs its own links only.
    const [gridG, linksG, overlayG, nodesG] = ["graph-grid", "graph-links", "graph-focus", "graph-nodes"]
      .map((c) => svg("g", {class: c}));
    graphSvg.append(gridG, linksG, overlayG, nodesG);
    let L = null, shown = null, linksDrawn = false;

    function fit() {  // the layout for the room the page has now (again if it made a scroll bar take some of it)
      for (let pass = 0; pass < 2; pass++) {
        const width = scroll.clientWidth || document.documentElement.clientWidth - 40;
        const top = scroll.getBoundingClientRect().top + window.scrollY;  // the rest of the first screen, at least 360
        L = layout({metadata: data.metadata, nodes: data.nodes.filter((n) => !ctx.off.has(n.id))}, width - 2, Math.max(360, Math.min(window.innerHeight * 0.8, window.innerHeight - top - 16)));
        graphSvg.setAttribute("width", L.width);
        graphSvg.setAttribute("height", L.height);
        graphSvg.setAttribute("viewBox", `0 0 ${L.width} ${L.height}`);
        if (!scroll.clientWidth || scroll.clientWidth >= L.width) break;
      }
      gridG.replaceChildren(gridLayer(data, L));
      linksDrawn = false;
    }

    function refilter() {
      shown = fig.subgraph ? GraphFigure.subgraph(data, fig, ctx.off, groups.of)
        : visible(data, state.nodeT, state.edgeT, state.hidden, ctx.off);
      linksDrawn = false;
    }

    function draw() {
      const sel = state.selected && shown.nodes.has(state.selected) ? state.selected : null;
      state.selected = sel;
      const drivers = sel ? byId.get(sel).drivers : null;
      const focus = drivers ? new Set([sel, ...drivers.map(([i]) => data.nodes[i].id)]) : null;
      if (shown.links.length <= MAX_FADED) {  // small: every link drawn again, faded or not
        linksG.replaceChildren(linkLayer(shown, L, sel, focus, maxAbs, state.link));
        linksDrawn = false;
      } else if (!linksDrawn) {
        linksG.replaceChildren(linkLayer(shown, L, null, null, maxAbs, null));
        linksDrawn = true;
      }
      linksG.style.opacity = sel && shown.links.length > MAX_FADED ? "0.12" : "";  // faded as one group: cheap
      overlayG.replaceChildren(sel && shown.links.length > MAX_FADED ? linkLayer(shown, L, sel, focus, maxAbs, state.link)
      : "");
      nodesG.replaceChildren(nodeLayer(ctx, shown, L, sel, focus));
      const drawnNeurons = graph.nodes.filter((n) => isNeuron(n) && shown.nodes.has(n.id)).length;
      const drawnGroups = groups.groups.filter((g) => shown.nodes.has(g.id)).length;
      count.textContent = `shown: ${drawnNeurons} of ${nNeurons} neurons` +
        (drawnGroups ? ` and ${drawnGroups} collapsed group${drawnGroups > 1 ? "s" : ""}` : "") +
        ` (${shown.nodes.size} nodes), ${shown.links.length} links (the graph: ${graph.nodes.length} nodes, ` +
        `${graph.links.length} links)`;
      details.replaceChildren(...GraphPanels.details(ctx, sel, shown));
      linkDetails.replaceChildren(...GraphHeads.linkPanel(ctx, state.link));
      focusNote.replaceChildren(...(sel === null ? highlightNote() : [`Showing what drives ${GraphPanels.nodeLabel(byId.get(sel), tokens)}` +
        (drivers ? `: its ${drivers.length} drivers and the links among them, the rest faded (listed below the graph). `
          : " (its edges highlighted; details below the graph). "),
      h("button", {type: "button", id: "focus-clear", onclick: () => select(null)}, "show the whole graph")]));
      for (const b of container.querySelectorAll(".logit-pick")) b.classList.toggle("picked", b.dataset.id === sel);
    }

    function select(id) {
      state.selected = id === null || state.selected === id ? null : id;
      if (state.selected !== null && ctx.off.has(state.selected) && groups.of.has(state.selected)) {
        groups.open([state.selected]);  // a member of a collapsed group: its group expanded
        return regroup();
      }
      draw();
    }

    function toggleGroup(id) {  // a group expanded into its members, or collapsed back
      if (groups.expanded.has(id)) groups.expanded.delete(id); else groups.expanded.add(id);
      regroup();
    }

    function regroup() {  // the groups' state changed: the nodes drawn, their places and the group list again
      ctx.off = groups.off();
      groupList.replaceChildren(GraphGroups.panel(data, groups, regroup) || "");
      refilter();
      fit();
      draw();
    }

    function pin(id) {  // a node pinned or unpinned; a group: its members
      const n = byId.get(id);
      const ids = n && n.members ? n.members : [id];
      const on = ids.some((m) => fig.pinned.has(m));
      for (const m of ids) if (on) fig.pinned.delete(m); else fig.pinned.add(m);
      figure.replaceChildren(GraphFigure.panel(ctx, graph, fig, act));
      refilter();
      draw();
    }

    function pickLink(link) {  // a link's head loadings, shown above the node's details
      state.link = link === null || state.link === link ? null : link;
      draw();
      if (state.link) linkDetails.scrollIntoView({block: "nearest"});
    }

    function highlightNote() {  // what an attention page's component names on the graph
      if (!highlight || !(ctx.highlit.size || highlight.text)) return [];
      const clear = () => { ctx.highlit.clear(); highlight.text = ""; draw(); };
      return [h("span", {id: "highlight-note"}, highlight.text), " ",
        h("button", {type: "button", id: "highlight-clear", onclick: clear}, "clear")];
    }

    for (const [s, key] of [[nodeSlider, "nodeT"], [edgeSlider, "edgeT"]]) {
      s.input.addEventListener("input", () => {
        state[key] = Number(s.input.value);
        s.shown.textContent = state[key].toFixed(2);
        refilter();
        draw();
      });
    }
    const positions = GraphPanels.positionFilter(tokens, state.hidden, (k, hide) => {
      if (hide) state.hidden.add(k); else state.hidden.delete(k);
      refilter();
      draw();
    });
    const info = data.metadata.info;
    const facts = [["model", info.model], ["family", info.family], ["dtype", info.dtype],
      ["exact", info.exact == null ? null : String(info.exact)], ["error nodes", info.error_nodes],
      ["completeness", info.completeness == null ? null : Number(info.completeness).toExponential(1)],
      ["node threshold (pruned at)", data.metadata.node_threshold], ["edge threshold (pruned at)", info.edge_threshold],
      ["nodes before pruning", info.nodes_before_pruning]].filter(([, v]) => v != null);
    const legend = h("div", {class: "legend"}, [["positive", COLORS.positive], ["negative", COLORS.negative]]
      .map(([t, c]) => { const sw = h("i"); sw.style.background = c; return h("span", {}, sw, `${t} weight`); }),
    h("span", {}, "width ∝ |weight| · ■ token · ● neuron · ◆ logit (token, probability) · ▲ bias" +
      (groups.groups.length ? " · ▬ group (click: its members)" : "")));
    const groupList = h("div", {id: "group-list"}, GraphGroups.panel(data, groups, regroup) || "");
    const act = {pin, groupOf: groups.of, selected: () => state.selected, graph: () => grouped, data: () => data,
      redraw: () => { refilter(); draw(); }, rebuild: () => show(container, graph, {...opts, select: state.selected}),
      subgraph: () => GraphFigure.subgraph(data, fig, ctx.off, groups.of)};
    const figure = h("div", {id: "figure-holder"}, GraphFigure.panel(ctx, graph, fig, act));
    const page = h("div", {class: "graph-page"},
      h("div", {class: "facts-inline", id: "graph-facts"}, facts.map(([k, v]) =>
        h("span", {}, h("span", {class: "note"}, k), " ", String(v)))),
      GraphPanels.logitBar(data, select), GraphTarget.panel(data, GraphPanels.num, GraphPanels.quoted), focusNote,
      h("div", {class: "controls"}, nodeSlider.el, edgeSlider.el, count), positions, groupList, figure, legend, scroll,
      h("section", {class: "panel"}, linkDetails, details), GraphHeads.headsPanel(ctx), GraphInterventions.panel(ctx));
    container.replaceChildren(page);
    GraphFigure.keys(page, act);
    refilter();
    fit();
    draw();
    let pending = null;
    const onResize = () => {
      if (!page.isConnected) { window.removeEventListener("resize", onResize); return; }
      clearTimeout(pending);
      pending = setTimeout(() => { fit(); draw(); }, 80);
    };
    window.addEventListener("resize", onResize);
  }

  return {show, visible};
})();
