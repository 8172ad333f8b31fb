// detjac view: attention heads on the graph page: a clicked link's head loadings (per crossed layer, the heads that
// carry the most of its weight, and the skip) and the heads panel (heads ranked by how much of the top logit's graph
// they carry, each linked to its attention page or given the command that makes it; and every head's direct effect on
// a logit target; a click on a column's header sorts by it). Text only ever as text.
"use strict";

const GraphHeads = (() => {
  const {h} = Dom;
  const {num, nodeLabel} = GraphPanels;

  // The attention page of head `layer`.`head` among the page keys `pages` (its key), or null: the one at `query`
  // when there is one.
  function headPage(pages, layer, head, query) {
    const keys = (pages || []).filter((k) => k.startsWith(`attention/${layer}.${head}.`));
    return keys.find((k) => k === `attention/${layer}.${head}.${query}`) || keys[0] || null;
  }

  const pageHref = (key) => "#/" + key.split("/").map(encodeURIComponent).join("/");

  // A head's name, a link to its attention page where the viewer has one.
  function headName(data, layer, head, query) {
    const key = headPage(data.metadata.attention, layer, head, query);
    const text = `${layer}.${head}`;
    return key ? h("a", {href: pageHref(key), class: "head-link mono", "data-head": text}, text)
      : h("span", {class: "mono", "data-head": text}, text);
  }

  // A bar as long as |w| against `max` (at most `px` pixels), coloured by its sign.
  function bar(w, max, px = 60) {
    const b = h("span", {class: "bar " + (w >= 0 ? "bar-positive" : "bar-negative")});
    b.style.width = `${Math.max(1, Math.round(px * Math.abs(w) / (max || 1)))}px`;
    return b;
  }

  const loadedCount = (data) => data.metadata.heads ? data.metadata.heads.loaded : 0;

  // The clicked link: its ends and weight, and its head loadings (or why there are none).
  function linkPanel(ctx, link) {
    if (!link) return [];
    const {data, byId, tokens} = ctx;
    const [a, b] = [byId.get(link.source), byId.get(link.target)];
    const head = h("h3", {id: "link-label"}, "Link ", h("span", {class: "text"}, nodeLabel(a, tokens)), " → ",
      h("span", {class: "text"}, nodeLabel(b, tokens)), ` · weight ${num(link.weight)}`,
      h("button", {type: "button", id: "link-clear", onclick: () => ctx.pickLink(null)}, "close"));
    if (link.parts) {  // a group's link (graph_groups.js)
      return [head, h("p", {class: "note", id: "link-no-loadings"}, `This link is the sum of ${link.parts} links of ` +
        "a group's members (computed by detjac view, exactly); expand the group for each link and its head loadings.")];
    }
    if (!link.heads) {
      return [head, h("p", {class: "note", id: "link-no-loadings"},
        `This link has no head loadings (${loadedCount(data)} of the graph's ${data.links.filter((l) => !l.parts).length} links have them). ` +
        "`detjac graph ... --heads N` loads the N strongest links (by |weight|): per attention layer the link can " +
        "cross, how much of its weight travels through each head, and the skip.")];
    }
    const query = b.ctx;
    if (!link.heads.length) {
      return [head, h("p", {class: "note", id: "link-no-layer"}, "This link crosses no attention layer (loaded: " +
        "none of its weight can travel through a head).")];
    }
    return [head,
      h("p", {class: "note"}, "Head loadings: per attention layer the link can cross, the part of its weight that " +
        "travels through each head (the largest shown) and the skip, the part that bypasses the layer's attention; " +
        "each layer's heads and skip sum to the link's weight."),
      h("table", {id: "link-loadings", class: "edges"},
        h("thead", {}, h("tr", {}, ["layer", "heads carrying the most (layer.head: loading)", "other heads", "skip"]
          .map((t) => h("th", {}, t)))),
        h("tbody", {}, link.heads.map((x) => {
          const max = Math.max(Math.abs(x.skip), ...x.top.map(([, w]) => Math.abs(w)));
          return h("tr", {"data-layer": x.layer},
            h("td", {class: "num"}, x.layer),
            h("td", {class: "loadings"}, x.top.map(([hd, w]) => h("span", {class: "loading", "data-head": `${x.layer}.${hd}`,
              "data-loading": w}, headName(data, x.layer, hd, query), " ", bar(w, max), " ",
            h("span", {class: "num " + (w >= 0 ? "positive" : "negative")}, num(w))))),
            h("td", {class: "num"}, x.n_rest ? `${num(x.rest)} (${x.n_rest})` : "–"),
            h("td", {class: "num skip", "data-skip": x.skip}, bar(x.skip, max), " ", num(x.skip)));
        })))];
  }

  // Every head's direct effect on target `k` (graph_heads.py: head_effect_rows), largest |effect| first; a click on a
  // header sorts by that column.
  function effectsTable(data, E, k, query) {
    const rows = [...E.rows].sort((a, b) => Math.abs(b.effects[k]) - Math.abs(a.effects[k]) || a.layer - b.layer ||
      a.head - b.head);
    const max = Math.max(...rows.map((r) => Math.abs(r.effects[k])), 1e-300);
    return TableSort.sortable(h("table", {id: "head-effects-table", class: "edges", "data-target": E.targets[k]},
      h("thead", {}, h("tr", {}, ["#", "head", "direct effect", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.map((r, i) => {
        const w = r.effects[k];
        return h("tr", {"data-head": `${r.layer}.${r.head}`, "data-effect": w},
          h("td", {class: "num", "data-value": i + 1}, i + 1),
          h("td", {"data-value": r.layer * 1e6 + r.head}, headName(data, r.layer, r.head, query)),
          h("td", {class: "num " + (w >= 0 ? "positive" : "negative"), "data-value": w}, num(w)),
          h("td", {}, bar(w, max)));
      }))), [true, true, true, null]);
  }

  // The direct effects part of the heads panel: the first target's, a selector where the graph has more than one.
  function effectsPart(ctx) {
    const {data, byId, tokens} = ctx;
    const E = data.metadata.heads && data.metadata.heads.effects;
    if (!E) return [];
    const label = (k) => (byId.get(E.targets[k]) ? nodeLabel(byId.get(E.targets[k]), tokens) : E.targets[k]);
    const query = byId.get(E.targets[0]) ? byId.get(E.targets[0]).ctx : null;
    let table = effectsTable(data, E, 0, query);
    const named = h("span", {class: "text", id: "head-effects-label"}, label(0));
    const choose = (event) => {
      const k = Number(event.target.value);
      const fresh = effectsTable(data, E, k, query);
      table.replaceWith(fresh);
      table = fresh;
      named.textContent = label(k);
    };
    return [h("h3", {id: "head-effects-title"}, `Direct effect of each of the ${E.rows.length} heads on `, named),
      E.targets.length > 1 ? h("label", {}, "target ", h("select", {id: "head-effects-select", onchange: choose},
        E.targets.map((_, k) => h("option", {value: k}, label(k))))) : null,
      h("p", {class: "note", id: "head-effects-meaning"}, E.meaning), table];
  }

  // The heads panel (detjac/view/graph_heads.py: the definition; docs/graphs.md, "In the viewer").
  function headsPanel(ctx) {
    const {data, byId} = ctx;
    const H = data.metadata.heads;
    const title = h("h2", {}, "Heads");
    if (!H || !H.loaded) {
      return h("section", {class: "panel", id: "heads-panel"}, title, h("p", {class: "note", id: "heads-none"},
        "No link of this graph has head loadings. `detjac graph ... --heads N` loads its N strongest links " +
        "(by |weight|); the heads are then ranked here by how much of the top logit's graph they carry."),
      effectsPart(ctx));
    }
    const logit = H.logit ? byId.get(H.logit) : null;
    const query = logit ? logit.ctx : null;
    const max = Math.max(...H.rows.map((r) => Math.abs(r.flow)), 1e-300);
    return h("section", {class: "panel", id: "heads-panel"},
      h("h2", {}, "Heads carrying ", h("span", {class: "text"}, logit ? nodeLabel(logit, ctx.tokens) : "the top logit")),
      h("p", {class: "note", id: "heads-coverage"}, `${H.loaded} of ${H.links} links loaded; ` +
        `${H.loaded_into_logit} of the ${H.into_logit} links into the top logit.`),
      TableSort.sortable(h("table", {id: "heads-table", class: "edges"},  // sorted by any column (table_sort.js)
        h("thead", {}, h("tr", {}, ["#", "head", "carried share", "", "direct", "attention"].map((t) => h("th", {}, t)))),
        h("tbody", {}, H.rows.map((r, i) => h("tr", {"data-head": `${r.layer}.${r.head}`},
          h("td", {class: "num", "data-value": i + 1}, i + 1),
          h("td", {"data-value": r.layer * 1e6 + r.head}, headName(data, r.layer, r.head, query)),
          h("td", {class: "num " + (r.flow >= 0 ? "positive" : "negative"), "data-value": r.flow}, num(r.flow)),
          h("td", {}, bar(r.flow, max)),
          h("td", {class: "num", "data-value": r.direct}, num(r.direct)),
          h("td", {"data-value": r.page ? "page" : "command"}, r.page
            ? h("a", {href: pageHref(r.page), class: "attention-link"}, "attention pattern")
            : h("code", {class: "command"}, r.command)))))), [true, true, true, null, true, false]),
      h("details", {}, h("summary", {}, "per layer: the flow its loaded links carry, and the skip's"),
        h("table", {id: "heads-layers", class: "edges"}, h("thead", {}, h("tr", {}, ["layer", "covered", "skip"]
          .map((t) => h("th", {}, t)))),
        h("tbody", {}, H.layers.map((x) => h("tr", {}, h("td", {class: "num"}, x.layer),
          h("td", {class: "num"}, num(x.covered)), h("td", {class: "num"}, num(x.skip))))))),
      h("p", {class: "note", id: "heads-meaning"}, H.meaning),
      H.rows.some((r) => r.command) ? h("p", {class: "note"}, "A head without an attention page: run its command, " +
        "then `detjac view` the graph again (files named GRAPH.qk.*.json beside the graph are found; or pass " +
        "--attention FILE).") : null,
      effectsPart(ctx));
  }

  return {linkPanel, headsPanel, headPage, pageHref, bar};
})();
