// detjac view: the graph page's target panel: what the graph explains and each token's exact signed contribution to
// it (detjac/view/graph_target.py), largest first, sortable, with their sum beside the target's value. Text from the
// graph (tokens, labels) is set with textContent only.
"use strict";

const GraphTarget = (() => {
  const {h} = Dom;

  function table(t, num, quoted, aside) {
    const scale = Math.max(...t.tokens.map(([, , v]) => Math.abs(v)), 1e-300);
    const rows = [...t.tokens].sort((a, b) => Math.abs(b[2]) - Math.abs(a[2]));
    const body = h("tbody", {}, rows.map(([q, token, v]) => {
      const bar = h("i", {class: "bar " + (v >= 0 ? "bar-positive" : "bar-negative")});
      bar.style.width = `${(100 * Math.abs(v) / scale).toFixed(1)}%`;
      return h("tr", {"data-position": q},
        h("td", {class: "num", "data-value": q}, q), h("td", {class: "mono", "data-value": token}, quoted(token)),
        h("td", {class: "num " + (v >= 0 ? "positive" : "negative"), "data-value": v}, (v >= 0 ? "+" : "") + num(v, 4)),
        h("td", {class: "barcell"}, aside.includes(q) ? h("span", {class: "note"}, "set aside") : bar));
    }));
    const el = h("table", {class: "edges", id: "contributions-table"},
      h("thead", {}, h("tr", {}, ["position", "token", "contribution", ""].map((c) => h("th", {}, c)))), body,
      h("tfoot", {}, h("tr", {}, h("td", {colspan: 2}, "constants"), h("td", {class: "num", id: "contributions-constants"},
        num(t.constants, 4)), h("td", {})),
      h("tr", {}, h("td", {colspan: 2}, "sum"), h("td", {class: "num", id: "contributions-sum"}, num(t.sum, 6)),
        h("td", {class: "note"}, `target value ${num(t.value, 6)}`))));
    return TableSort.sortable(el, [true, false, true, null]);
  }

  // The panel: a button per logit node where there are several; the first shown.
  function panel(data, num, quoted) {
    const target = data.metadata.target;
    if (!target || !target.targets.length) return null;
    const holder = h("div", {id: "contributions-holder"});
    const show = (t) => {
      holder.replaceChildren(h("p", {id: "contributions-of"}, "Contributions to ",
        h("span", {class: "mono"}, target.text ?? t.label), ` = ${num(t.value, 6)}`), table(t, num, quoted, target.aside));
      for (const b of picks) b.classList.toggle("active", b.dataset.id === t.id);
    };
    const picks = target.targets.length > 1 ? target.targets.map((t) => h("button", {type: "button",
      class: "contribution-pick", "data-id": t.id, onclick: () => show(t)}, t.label)) : [];
    const el = h("section", {class: "panel", id: "target-panel"}, h("h3", {}, "The target, token by token"),
      target.aside.length ? h("p", {class: "note aside", id: "aside-note"}, target.aside_meaning) : null,
      picks.length ? h("div", {class: "controls"}, picks) : null, holder, h("p", {class: "note"}, target.meaning));
    show(target.targets[0]);
    return el;
  }

  return {panel};
})();
