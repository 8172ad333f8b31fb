// detjac view: a head's attention page (a `detjac attention --out` file shown with its graph): the head's pattern at the
// query position (a bar per key position) and, for a picked key, its score by its parts: each component's sum on the
// query side and on the key side, the largest pairs, and the contrast with another key (the score difference split
// per component on each side; default the most attended other key). Every table ends with the row of what its other
// rows add up to, so it sums to its total. Each component is a click away from what it names: A{l}.{h} opens that
// head's page, M{l}, E and B{l} select or highlight their nodes on the graph. Token texts and component names only
// ever go into the page as text.
"use strict";

const AttentionPage = (() => {
  const {h} = Dom;
  const {num, quoted} = GraphPanels;
  const COMPONENT = /^(?:(E)|(B)|(bias)|A(\d+)\.(\d+)|M(\d+)(?:\.(\d+|rest))?|B(\d+))$/;
  const SHOWN = 12;  // rows of each sums table; the rest summed in one row
  const graphHref = (...parts) => "#/" + ["graph", ...parts].map((p) => encodeURIComponent(String(p))).join("/");

  // What a component names at position `pos`: {text (what it is), href (where a click goes) or command}. What the
  // page knows of its graph (`qk.graph`): its node ids (not its links), its attention pages, the command's start.
  function target(qk, name, pos) {
    const m = COMPONENT.exec(name) || [];
    const at = `at position ${pos} ${quoted(qk.tokens[pos])}`;
    const graph = qk.graph || {nodes: [], attention: []};
    const has = (id) => graph.nodes.includes(id);
    if (m[1]) return {text: `the token embedding ${at}`, href: graphHref("node", `E_${qk.token_ids[pos]}_${pos}`)};
    if (m[2]) return {text: `the position embeddings ${at} (no node on the graph)`};
    if (m[3]) return {text: "the constants of this head's own query or key path (no node on the graph)"};
    if (m[4] != null) {
      const key = GraphHeads.headPage(graph.attention, m[4], m[5], pos);
      return key ? {text: `head ${m[5]} of layer ${m[4]} ${at}: its attention page`, href: GraphHeads.pageHref(key)}
        : {text: `head ${m[5]} of layer ${m[4]} ${at}; no attention page for it here. Make one with:`,
          command: commandFor(graph, m[4], m[5])};
    }
    if (m[6] != null) {
      const neuron = m[7] != null && m[7] !== "rest" ? `${m[6]}_${m[7]}_${pos}` : null;
      if (neuron && has(neuron)) return {text: `neuron ${m[7]} of layer ${m[6]} ${at}`, href: graphHref("node", neuron)};
      const what = m[7] === "rest" ? `the rest of layer ${m[6]}'s MLP` : neuron ? `neuron ${m[7]} of layer ${m[6]}`
        : `the MLP of layer ${m[6]}`;
      return {text: `${what} ${at}: its layer's neurons there on the graph`, href: graphHref("neurons", m[6], pos)};
    }
    if (m[8] != null) {
      const bias = `B_${m[8]}_${pos}`;
      return has(bias) ? {text: `the constants of layer ${m[8]} ${at}`, href: graphHref("node", bias)}
        : {text: `the constants of layer ${m[8]} ${at} (not a node of this graph)`};
    }
    return {text: name};
  }

  function commandFor(graph, layer, head) {
    const c = graph.attention_command;
    return c ? `${c.prefix} --layer ${layer} --head ${head} --out ${c.stem}.qk.L${layer}.H${head}.json` : null;
  }

  function component(qk, name, pos, side, onNote) {
    const t = target(qk, name, pos);
    const attrs = {class: "component mono", "data-component": name, "data-side": side, title: t.text};
    if (t.href) return h("a", {...attrs, href: t.href}, name);
    return h("button", {...attrs, type: "button", onclick: () => onNote(t)}, name);
  }

  // Per component, its value in `a` minus in `b` (0 where a list lacks it), largest |value| first (ties by name): one
  // side's split of the difference of two keys' scores (detjac.qk_sums.contrast_sums).
  function contrastSums(a, b) {
    const out = new Map(a);
    for (const [c, v] of b) out.set(c, (out.get(c) || 0) - v);
    return [...out].sort((x, y) => Math.abs(y[1]) - Math.abs(x[1]) || (x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0));
  }

  // The most attended key other than `skip` (ties: the earlier position): the contrast's default other key.
  const mostAttended = (keys, skip) => keys.filter((k) => k.position !== skip)
    .reduce((a, b) => (b.probability > a.probability ? b : a)).position;

  // A table of [component, value] rows at position `pos`: the SHOWN largest, then the others' sum.
  function sumsTable(qk, id, rows, pos, side, title, onNote) {
    const shown = rows.slice(0, SHOWN), rest = rows.slice(SHOWN);
    const restSum = rest.reduce((t, [, v]) => t + v, 0);
    const max = Math.max(...shown.map(([, v]) => Math.abs(v)), 1e-300);
    return h("table", {id, class: "edges sums"},
      h("thead", {}, h("tr", {}, [title, "sum", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, shown.map(([c, v]) => h("tr", {"data-component": c},
        h("td", {}, component(qk, c, pos, side, onNote)),
        h("td", {class: "num sum " + (v >= 0 ? "positive" : "negative"), "data-value": v}, num(v)),
        h("td", {}, GraphHeads.bar(v, max, 120)))),
      rest.length ? h("tr", {class: "rest"}, h("td", {class: "note"}, `the other ${rest.length} components`),
        h("td", {class: "num sum", "data-value": restSum}, num(restSum)), h("td", {}, "")) : null));
  }

  // The page: the pattern, the picked key's parts (the most attended first).
  function show(container, qk) {
    const i = qk.query_position;
    const best = qk.keys.reduce((a, b) => (b.probability > a.probability ? b : a));
    const state = {key: best.position, other: null};  // other: null for the default
    const termsBox = h("div", {id: "terms-box"});
    const noteBox = h("p", {class: "note", id: "component-note"});
    const onNote = (t) => noteBox.replaceChildren(t.text, t.command ? " " : "",
      t.command ? h("code", {class: "command", id: "component-command"}, t.command) : "");
    const maxP = Math.max(...qk.keys.map((k) => k.probability), 1e-300);
    const rows = qk.keys.map((k) => h("tr", {class: "clickable", "data-position": k.position,
      onclick: () => { state.key = k.position; state.other = null; draw(); }},
    h("td", {class: "num"}, k.position), h("td", {class: "text mono"}, quoted(qk.tokens[k.position])),
    h("td", {}, GraphHeads.bar(k.probability, maxP, 160)), h("td", {class: "num prob"}, k.probability.toFixed(3)),
    h("td", {class: "num"}, num(k.score))));

    function draw() {
      for (const r of rows) r.classList.toggle("picked", Number(r.dataset.position) === state.key);
      const k = qk.keys.find((x) => x.position === state.key);
      const maxT = Math.max(...k.terms.map((t) => Math.abs(t[2])), 1e-300);
      const at = quoted(qk.tokens[k.position]);
      termsBox.replaceChildren(
        h("h2", {id: "sums-title"}, `Key ${k.position} `, h("span", {class: "text"}, at), ` (p=` +
          `${k.probability.toFixed(3)}, score ${num(k.score)}) by its parts: each component summed over the other side`),
        h("div", {class: "sums-pair"},
          sumsTable(qk, "query-sums", k.query_sums, i, "query", `query side (at ${i})`, onNote),
          sumsTable(qk, "key-sums", k.key_sums, k.position, "key", `key side (at ${k.position})`, onNote)),
        h("h2", {id: "terms-title"}, `Largest QK terms at key ${k.position} `, h("span", {class: "text"},
          quoted(qk.tokens[k.position])), ` (p=${k.probability.toFixed(3)}, score ${num(k.score)}, the sum of its ` +
          `${k.n_terms} terms)`),
        h("table", {id: "terms", class: "edges"},
          h("thead", {}, h("tr", {}, ["#", `query side (at ${i})`, `key side (at ${k.position})`, "term", ""]
            .map((t) => h("th", {}, t)))),
          h("tbody", {}, k.terms.map(([q, kk, v], r) => h("tr", {"data-query": q, "data-key": kk},
            h("td", {class: "num"}, r + 1), h("td", {}, component(qk, q, i, "query", onNote)),
            h("td", {}, component(qk, kk, k.position, "key", onNote)),
            h("td", {class: "num term " + (v >= 0 ? "positive" : "negative")}, num(v)),
            h("td", {}, GraphHeads.bar(v, maxT, 160)))),
          k.n_terms > k.terms.length ? h("tr", {id: "terms-rest"}, h("td", {}, ""),
            h("td", {colspan: 2, class: "note"}, `the other ${k.n_terms - k.terms.length} terms`),
            h("td", {class: "num"}, num(k.rest)), h("td", {}, "")) : null)),
        contrastBox(k), noteBox);
    }

    // The picked key against another (a select; default the most attended other key): the score difference split
    // per component on each side.
    function contrastBox(k) {
      if (qk.keys.length < 2) return h("p", {class: "note", id: "contrast-none"}, "One key only: nothing to contrast.");
      const otherPos = state.other ?? mostAttended(qk.keys, k.position);
      const o = qk.keys.find((x) => x.position === otherPos);
      const pick = h("select", {id: "contrast-other", "aria-label": "the key to contrast with",
        onchange: (e) => { state.other = Number(e.target.value); draw(); }},
      qk.keys.filter((x) => x.position !== k.position).map((x) => h("option", {value: x.position,
        selected: x.position === otherPos}, `${x.position} ${quoted(qk.tokens[x.position])} (p=` +
        `${x.probability.toFixed(3)})`)));
      return h("section", {id: "contrast"},
        h("h2", {id: "contrast-title"}, `Contrast: key ${k.position} `, h("span", {class: "text"},
          quoted(qk.tokens[k.position])), " against key ", pick, `: score difference ${num(k.score - o.score)} ` +
          `(${num(k.score)} − ${num(o.score)})`),
        h("div", {class: "sums-pair"},
          sumsTable(qk, "contrast-query", contrastSums(k.query_sums, o.query_sums), i, "query",
            `query side (at ${i})`, onNote),
          sumsTable(qk, "contrast-key", contrastSums(k.key_sums, o.key_sums), k.position, "key",
            `key side (at ${k.position} vs ${o.position})`, onNote)),
        h("p", {class: "note"}, "Each row: the component's sum over the other side at this key minus at the other " +
          "key (0 where it is no component there). The score is linear in each side, so each table adds up to the " +
          "difference exactly."));
    }

    const m = qk.model;
    const facts = [["model", m.source || m.name_or_path], ["family", m.family], ["dtype", m.dtype], ["file", qk.file],
      ["keys", qk.keys.length], ["terms vs score", qk.score_error == null ? null : qk.score_error.toExponential(1)]]
      .filter(([, v]) => v != null);
    container.replaceChildren(
      h("h1", {}, `Head ${qk.layer}.${qk.head} at query ${i} `, h("span", {class: "text", id: "query-token"},
        quoted(qk.tokens[i]))),
      h("div", {class: "facts-inline", id: "attention-facts"}, facts.map(([k, v]) =>
        h("span", {}, h("span", {class: "note"}, k), " ", String(v)))),
      h("section", {class: "panel"}, h("h2", {}, "Attention pattern at the query (click a key for its parts)"),
        h("table", {id: "pattern", class: "edges"}, h("thead", {}, h("tr", {}, ["key", "token", "", "p", "score"]
          .map((t) => h("th", {}, t)))), h("tbody", {}, rows)),
        h("p", {class: "note"}, "The score is the head's pre-softmax score (scaled, before the mask and any " +
          "soft-cap); each term is the score computed from one component of the residual stream at the query " +
          "against one at the key, and the terms sum to the score exactly. A component's click opens what it " +
          "names: a head's attention page, or its node(s) on the graph.")),
      h("section", {class: "panel"}, termsBox));
    draw();
  }

  // The graph page's options for a route #/graph/node/ID or #/graph/neurons/LAYER/POS: the node selected, or the
  // layer's neurons at that position highlighted; a line saying what is shown (or that the graph lacks it).
  function graphFocus(graph, parts) {
    const tokens = graph.metadata.prompt_tokens;
    if (parts[0] === "node" && parts[1]) {
      const found = graph.nodes.some((n) => n.id === parts[1]);
      return found ? {select: parts[1]} : {highlight: {ids: [], text: `${parts[1]} is not a node of this graph ` +
        "(pruned, or never ranked into it)."}};
    }
    if (parts[0] === "neurons" && parts.length >= 3) {
      const [layer, pos] = [parts[1], Number(parts[2])];
      const ids = graph.nodes.filter((n) => n.type === NODE_KIND.NEURON && n.layer === layer && n.ctx === pos)
        .map((n) => n.id);
      const at = `layer ${layer} at position ${pos} ${quoted(tokens[pos])}`;
      return {highlight: {ids, text: ids.length ? `Highlighted: the ${ids.length} neurons of ${at} in this graph.`
        : `No neuron of ${at} is in this graph (pruned, or never ranked into it).`}};
    }
    return {};
  }

  return {show, graphFocus, target, contrastSums};
})();
