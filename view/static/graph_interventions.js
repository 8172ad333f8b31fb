// detjac view: the graph page's interventions panel. The user lists nodes (the selected neuron, or a head at a
// position), picks a mode (zero, mean over the prompt's positions, clamp to a value) and gets the new top tokens twice,
// side by side: as the exact linear (frozen) system predicts them and as the real model computes them. The live
// viewer started with --model computes them (POST api/intervene); a static export or a viewer without a model says
// so. Token texts and messages are set as text only.
"use strict";

const GraphInterventions = (() => {
  const {h} = Dom;
  const {num} = GraphPanels;
  const NEED = "Interventions need the live viewer started with the model: detjac view GRAPH.json --model MODEL.";
  const TOP_K = 10;
  const COLUMNS = [["before", "unedited (the model)"], ["linear", "linear prediction (frozen system)"],
    ["real", "real model"]];

  // The edit of a neuron node (`layer_index_position`), or null for any other node.
  function neuronEdit(n) {
    const m = n && n.type === NODE_KIND.NEURON ? /^(\d+)_(\d+)_(\d+)$/.exec(n.id) : null;
    return m ? {kind: "neuron", layer: Number(m[1]), index: Number(m[2]), position: Number(m[3])} : null;
  }

  const editName = (e) => `${e.kind} ${e.layer}.${e.index} at ${e.position}`;

  function column(data, name, title) {
    const c = data[name];
    return h("table", {class: "intervene-column", id: `intervene-${name}`},
      h("caption", {}, title),
      h("thead", {}, h("tr", {}, h("th", {}, "token"), h("th", {}, "logit"), h("th", {}, "p"))),
      h("tbody", {}, c.token_ids.map((id, k) => h("tr", {"data-token-id": id},
        h("td", {class: "text"}, JSON.stringify(c.tokens[k])), h("td", {class: "num"}, num(c.logits[k])),
        h("td", {class: "num prob"}, c.probabilities[k].toFixed(3))))));
  }

  function answer(data) {
    const change = (name) => h("span", {class: "num", id: `intervene-change-${name}`}, num(data[name].target_change));
    return [h("p", {id: "intervene-target"}, "Target ", h("span", {class: "text"}, JSON.stringify(data.target_token)),
      ": logit change, linear ", change("linear"), ", real ", change("real"), "."),
    h("div", {class: "intervene-columns"}, COLUMNS.map(([name, title]) => column(data, name, title)))];
  }

  // The panel; `ctx.selected()` is the selected node's id, `ctx.byId` the nodes by id.
  function panel(ctx) {
    const note = h("p", {class: "note", id: "intervene-note"});
    const section = h("section", {class: "panel", id: "interventions"}, h("h3", {}, "Interventions"));
    if (document.querySelector('meta[name="detjac-mode"]').content === "static") {
      note.textContent = NEED + " This page is a static export.";
      section.append(note);
      return section;
    }
    const edits = [];
    const list = h("ul", {id: "intervene-edits"});
    const result = h("div", {id: "intervene-result"});
    const mode = h("select", {id: "intervene-mode", "aria-label": "mode"},
      ["zero", "mean", "clamp"].map((m) => h("option", {value: m}, m)));
    const value = h("input", {id: "intervene-value", type: "number", step: "any", value: "0", "aria-label": "value"});
    const head = ["layer", "head", "position"].map((k) => h("input", {type: "number", min: "0", step: "1",
      id: `intervene-head-${k}`, "aria-label": `head's ${k}`, placeholder: k, class: "small-number"}));
    const run = h("button", {type: "button", id: "intervene-run", disabled: true, onclick: go}, "intervene");

    function redraw() {
      list.replaceChildren(...edits.map((e, i) => h("li", {"data-edit": editName(e)}, editName(e), " ",
        h("button", {type: "button", class: "intervene-remove", onclick: () => { edits.splice(i, 1); redraw(); }},
          "remove"))));
      run.disabled = !edits.length;
    }

    function add(e) {
      if (!edits.some((x) => editName(x) === editName(e))) edits.push(e);
      note.textContent = "";
      redraw();
    }

    function addSelected() {
      const e = neuronEdit(ctx.byId.get(ctx.selected()));
      if (e) add(e);
      else note.textContent = "Select a neuron in the graph first (a click on its circle), or give a head below.";
    }

    function addHead() {
      const v = head.map((i) => i.value.trim());
      if (v.some((x) => !/^\d+$/.test(x))) {
        note.textContent = "Give the head's layer, index and position as whole numbers.";
        return;
      }
      add({kind: "head", layer: Number(v[0]), index: Number(v[1]), position: Number(v[2])});
    }

    async function go() {
      const clamp = mode.value === "clamp";
      if (clamp && !Number.isFinite(Number(value.value))) {
        note.textContent = "Give the value to clamp to as a number.";
        return;
      }
      const body = {top_k: TOP_K, edits: edits.map((e) => ({...e, mode: mode.value,
        ...(clamp ? {value: Number(value.value)} : {})}))};
      note.textContent = "computing…";
      result.replaceChildren();
      try {
        const r = await fetch("api/intervene", {method: "POST", headers: {"Content-Type": "application/json"},
          body: JSON.stringify(body)});
        const data = await r.json();
        if (!r.ok) { note.textContent = data.error || `error ${r.status}`; return; }
        note.textContent = "";
        result.replaceChildren(...answer(data));
      } catch (err) {
        note.textContent = `${err.message}. ${NEED}`;
      }
    }

    section.append(h("p", {class: "note"}, "Ablate (zero, or the mean over the prompt's positions) or clamp nodes " +
      "together, and compare the new top tokens as the exact linear system predicts them (gates, attention patterns " +
      "and norm scales frozen at this prompt's values) with what the real model computes."),
    h("div", {class: "controls"},
      h("button", {type: "button", id: "intervene-add-selected", onclick: addSelected}, "add the selected neuron"),
      " or head ", ...head, h("button", {type: "button", id: "intervene-add-head", onclick: addHead}, "add the head")),
    list,
    h("div", {class: "controls"}, h("label", {}, "mode ", mode), " ", h("label", {}, "clamp value ", value), " ", run),
    note, result);
    return section;
  }

  return {panel, NEED};
})();
