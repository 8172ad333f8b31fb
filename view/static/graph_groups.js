// detjac view: a graph's groups (supernodes, `detjac graph --group`), each drawn as one node at its layer until a click
// expands it into its members. Every number is computed by `detjac view` (detjac/view/graph_groups.py: a group's links
// are its members' sums, in float64); this script only chooses which nodes are drawn: a collapsed group's node in
// place of its members, an expanded group's members in place of it, and the links whose two ends are drawn. Names
// are set with textContent only.
"use strict";

const GraphGroups = (() => {
  const {svg, h} = Dom;

  // The graph with its groups' nodes and links appended (original indices unchanged: drivers index nodes) and the
  // state of its groups: `expanded` (ids), `of` (member id -> group id), `off()` (the ids not drawn).
  function attach(data) {
    const groups = data.groups ? data.groups.nodes : [];
    const all = groups.length ? {...data, nodes: [...data.nodes, ...groups], links: [...data.links, ...data.groups.links]}
      : data;
    const of = new Map(groups.flatMap((g) => g.members.map((m) => [m, g.id])));
    const state = {groups, expanded: new Set(), of};
    state.off = () => new Set([...groups.filter((g) => !state.expanded.has(g.id)).flatMap((g) => g.members),
      ...state.expanded]);
    state.open = (ids) => { for (const id of ids) if (of.has(id)) state.expanded.add(of.get(id)); };  // their groups
    return {all, state};
  }

  // A group's mark: a rounded box, wider with more members, and its name (shortened) with its member count beside it.
  function shape(n, x, y) {
    const w = Math.min(26, 10 + 2 * n.size);
    const name = n.name.length > 22 ? n.name.slice(0, 21) + "…" : n.name;
    return [svg("rect", {x: x - w / 2, y: y - 6, width: w, height: 12, rx: 5, class: "group-box"}),
      svg("text", {x: x + w / 2 + 3, y: y + 4, class: "group-label"}, `${name} ×${n.size}`)];  // haloed: readable
  }

  // The list of groups, each a button that expands or collapses it, and the note on what a group is (alone when no
  // group is drawn collapsed: it says why each is not).
  function panel(data, state, onChange) {
    const note = data.groups ? h("p", {class: "note", id: "group-note"}, data.groups.meaning) : null;
    if (!state.groups.length) return note && h("div", {class: "group-panel", id: "group-panel"}, note);  // why none
    const toggle = (id) => {
      if (state.expanded.has(id)) state.expanded.delete(id); else state.expanded.add(id);
      onChange();
    };
    const all = (open) => {
      state.expanded = new Set(open ? state.groups.map((g) => g.id) : []);
      onChange();
    };
    return h("div", {class: "group-panel", id: "group-panel"},
      h("div", {class: "controls"}, h("strong", {}, `Groups (${state.groups.length})`),
        state.groups.map((g) => h("button", {type: "button", class: "group-toggle", "data-id": g.id,
          "aria-pressed": String(state.expanded.has(g.id)), onclick: () => toggle(g.id)},
        state.expanded.has(g.id) ? "collapse " : "expand ", h("span", {class: "text"}, g.name), ` (${g.size})`)),
        h("button", {type: "button", id: "groups-expand", onclick: () => all(true)}, "expand all"),
        h("button", {type: "button", id: "groups-collapse", onclick: () => all(false)}, "collapse all")),
      note);
  }

  return {attach, shape, panel};
})();
