// detjac view: the graph page's panels around the drawing: the logits to pick ("what drives it"), the position filter,
// a node's details and edges, its drivers. Every text from a graph (tokens, clerps) is set with textContent only.
"use strict";

const GraphPanels = (() => {
  const {svg, h} = Dom;

  function num(x, digits = 4) {
    if (x == null) return "–";
    const v = Number(x), a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(digits - 1);
    return String(Number(v.toPrecision(digits)));
  }

  const quoted = (text) => JSON.stringify(text ?? "");

  function nodeLabel(n, tokens) {
    if (n.type === NODE_KIND.TOKEN) return `token ${n.ctx} ${quoted(tokens[n.ctx])}`;
    if (n.type === NODE_KIND.LOGIT && n.token != null) {
      const minus = n.minus == null ? "" : ` − ${quoted(n.minus)}`;  // a contrast target
      return `logit ${quoted(n.token)}${minus}${n.p == null ? "" : ` p=${n.p.toFixed(3)}`}`;
    }
    return n.clerp || n.id;
  }

  // The logits, most probable first, each a button that shows what drives it; each with its kept share, explained.
  function logitBar(data, onPick) {
    const logits = data.nodes.filter((n) => n.type === NODE_KIND.LOGIT);
    if (!logits.length) return null;
    const kept = data.metadata.info.logit_share_kept || [];
    const share = new Map(logits.map((n, i) => [n.id, kept[i]]));  // logit_share_kept is in the JSON's logit order
    const sorted = [...logits].sort((a, b) => (b.p ?? 0) - (a.p ?? 0));
    return h("div", {class: "logit-bar", id: "logit-bar"},
      h("div", {class: "controls"}, h("strong", {}, "What drives"),
        sorted.map((n) => h("button", {type: "button", class: "logit-pick", "data-id": n.id, onclick: () => onPick(n.id)},
          h("span", {class: "mono"}, data.metadata.target?.text ?? quoted(n.token ?? n.clerp)),
          n.p == null ? null : ` p=${n.p.toFixed(2)}`,
          share.get(n.id) == null ? null : h("span", {class: "note kept"}, ` · kept ${share.get(n.id).toFixed(2)}`)))),
      kept.length ? h("p", {class: "note", id: "kept-share-note"}, data.metadata.kept_share) : null);
  }

  // A checkbox per position: its neurons (and bias nodes) hidden while ticked (tokens and logits stay).
  function positionFilter(tokens, hidden, onChange) {
    return h("div", {class: "controls", id: "position-filter"}, h("span", {}, "Hide the neurons at positions:"),
      tokens.map((t, k) => {
        const box = h("input", {type: "checkbox", id: `hide-pos-${k}`, "data-position": k, checked: hidden.has(k)});
        box.addEventListener("change", () => onChange(k, box.checked));
        return h("label", {class: "position"}, box, h("span", {class: "mono"}, `${k} ${quoted(t)}`));
      }));
  }

  function edgeTable(ctx, id, title, edges, end) {
    return h("div", {}, h("h3", {}, `${title} (${edges.length})`),
      h("table", {id, class: "edges"}, h("thead", {}, h("tr", {}, ["node", "label", "weight", "heads"]
        .map((t) => h("th", {}, t)))),
        h("tbody", {}, edges.map((l) => {
          const other = ctx.byId.get(l[end]);
          const loadings = (e) => { e.stopPropagation(); ctx.pickLink(l); };  // the link's head loadings
          return h("tr", {class: "clickable", "data-id": other.id, onclick: () => ctx.select(other.id)},
            h("td", {class: "mono"}, other.id), h("td", {class: "text"}, nodeLabel(other, ctx.tokens)),
            h("td", {class: "num " + (l.weight >= 0 ? "positive" : "negative")}, num(l.weight)),
            h("td", {}, l.heads ? h("button", {type: "button", class: "loadings-button", onclick: loadings},
              "loadings") : ""));
        }))));
  }

  // "What drives it": the selected node's drivers (computed by `detjac view`: detjac/view/graph_drivers.py).
  function driversPanel(ctx, n) {
    const meta = ctx.data.metadata.drivers || {};
    if (n.drivers == null) {
      const why = n.type === NODE_KIND.TOKEN ? "a token has nothing upstream"
        : n.type === "group" ? "a group's drivers are its members' (click the group to expand it)"
        : `drivers are computed for the logits and the ${meta.computed} most influential nodes of this graph`;
      return h("div", {id: "drivers"}, h("p", {class: "note"}, `No drivers shown: ${why}.`));
    }
    const direct = new Map(ctx.data.links.filter((l) => l.target === n.id).map((l) => [l.source, l.weight]));
    return h("div", {id: "drivers"},
      h("h3", {}, "What drives ", h("span", {class: "text", id: "drivers-of"}, nodeLabel(n, ctx.tokens)),
        h("button", {type: "button", id: "show-all", onclick: () => ctx.select(null)}, "show the whole graph")),
      h("p", {class: "note"}, meta.meaning),
      h("table", {class: "edges", id: "drivers-table"},
        h("thead", {}, h("tr", {}, ["#", "node", "label", "driver share", "direct weight"].map((t) => h("th", {}, t)))),
        h("tbody", {}, n.drivers.map(([i, share], rank) => {
          const d = ctx.data.nodes[i], w = direct.get(d.id);
          return h("tr", {class: "clickable" + (ctx.hidden(d) ? " hidden-node" : ""), "data-id": d.id,
            onclick: () => ctx.select(d.id)},
          h("td", {class: "num"}, rank + 1), h("td", {class: "mono"}, d.id),
          h("td", {class: "text"}, nodeLabel(d, ctx.tokens)), h("td", {class: "num share"}, share.toFixed(3)),
          h("td", {class: "num " + (w == null ? "" : w >= 0 ? "positive" : "negative")}, w == null ? "–" : num(w)));
        }))));
  }

  function details(ctx, id, shown) {
    if (id === null) return [h("p", {class: "note"}, "Click a logit or a node for what drives it, its labels and edges.")];
    const n = ctx.byId.get(id), tokens = ctx.tokens;
    const order = (a, b) => Math.abs(b.weight) - Math.abs(a.weight);
    const incoming = shown.links.filter((l) => l.target === id).sort(order);
    const outgoing = shown.links.filter((l) => l.source === id).sort(order);
    const all = ctx.data.links.filter((l) => (l.target === id || l.source === id) &&  // drawn or filtered out
      !ctx.off.has(l.source) && !ctx.off.has(l.target)).length;
    const layer = n.type === NODE_KIND.TOKEN ? "tokens" : n.type === NODE_KIND.LOGIT ? "logits" : `layer ${n.layer}`;
    return [
      h("h3", {id: "node-label", class: "text"}, n.type === NODE_KIND.LOGIT ? n.clerp || nodeLabel(n, tokens) : nodeLabel(n, tokens)),
      h("dl", {class: "facts", id: "node-facts"}, [["node", n.id], ["type", n.type], ["layer", layer],
        ["position", `${n.ctx} ${quoted(tokens[n.ctx])}`], ["activation", n.activation == null ? null : num(n.activation, 6)],
        ["influence", n.influence == null ? null : num(n.influence, 4)], ["probability", n.p == null ? null : num(n.p, 4)],
        ["label (clerp)", n.clerp || null], ["members", n.members ? n.members.join(" ") : null]].filter(([, v]) => v != null)
        .map(([k, v]) => [h("dt", {}, k), h("dd", {"data-fact": k}, String(v))])),
      driversPanel(ctx, n),
      all > incoming.length + outgoing.length
        ? h("p", {class: "note"}, `${all - incoming.length - outgoing.length} more edges hidden by the filters`) : null,
      h("div", {class: "row"}, edgeTable(ctx, "incoming", "Incoming edges", incoming, "source"),
        edgeTable(ctx, "outgoing", "Outgoing edges", outgoing, "target"))].filter(Boolean);
  }

  return {svg, h, num, quoted, nodeLabel, logitBar, positionFilter, details};
})();
