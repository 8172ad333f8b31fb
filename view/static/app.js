// detjac view: the pages (corpus, prompt, layers, graph) drawn from the data of `detjac view` (api/) or of a snapshot (data/).
// Text from the store (prompts, tokens) only ever goes into the page as text nodes, never as markup.
"use strict";

(() => {
  const MODE = document.querySelector('meta[name="detjac-mode"]').content;
  const main = document.getElementById("main");
  const crumbs = document.getElementById("crumbs");
  const cache = new Map();
  const waiting = new Map();
  let generation = 0;  // a newer page replaces an older one still loading

  // -- data -------------------------------------------------------------------------------------------------------
  // Every page's data comes as a script calling detjacData(key, value[, error]): data/<key>.js in a snapshot opened
  // from disk (browsers load scripts from file:// but refuse fetch), api/<key>?js from `detjac view`. A script
  // inserted before the page's load event delays it (a fetch would not), so the first page is drawn when load fires.
  window.detjacData = (key, value, error) => {
    const w = waiting.get(key);
    if (!w) return;
    waiting.delete(key);
    if (error != null) w.reject(new Error(error));
    else w.resolve(value);
  };

  function load(key) {
    if (cache.has(key)) return cache.get(key);
    const p = new Promise((resolve, reject) => {
      waiting.set(key, {resolve, reject});
      const s = document.createElement("script");
      s.src = MODE === "static" ? "data/" + key.split("/").join(".") + ".js"
        : "api/" + key.split("/").map(encodeURIComponent).join("/") + "?js";
      const missing = () => {
        s.remove();
        if (!waiting.has(key)) return;
        waiting.delete(key);
        reject(new Error(MODE === "static" ? `This snapshot has no data for ${key} (was it exported with --prompt?).`
          : `No answer from detjac view for ${key} (is it still running?).`));
      };
      s.onerror = missing;
      s.onload = missing;
      document.head.appendChild(s);
    });
    p.catch(() => cache.delete(key));
    cache.set(key, p);
    return p;
  }

  // -- helpers ----------------------------------------------------------------------------------------------------
  const h = Dom.h;
  const note = (text) => h("p", {class: "note"}, text);
  const sci = (x) => (x == null ? "–" : Number(x).toExponential(2));
  function num(x, digits = 4) {  // `digits` significant digits; exponent notation for very large or small values
    if (x == null) return "–";
    const v = Number(x), a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(digits - 1);
    return String(Number(v.toPrecision(digits)));
  }
  const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(x < 0.1 ? 1 : 0)}%`);
  const promptHref = (id, ...rest) => "#/" + ["prompt", id, ...rest].map(encodeURIComponent).join("/");
  const chips = (texts, cls) => h("span", {class: cls || "chips"}, texts.map((t) => h("span", {class: "chip"}, t)));
  const panel = (title, ...body) => h("section", {class: "panel"}, title ? h("h2", {}, title) : null, ...body);

  function show(...nodes) { main.replaceChildren(...nodes.filter((n) => n != null)); }
  function fail(err) { show(h("p", {class: "error", id: "page-error"}, String(err.message || err))); }
  function setCrumbs(...parts) {
    crumbs.replaceChildren(...parts.flatMap((p, i) => (i ? [" › ", p] : [p])));
  }

  async function header() {
    const c = await load("corpus");
    if (c.neurons) document.documentElement.dataset.neurons = document.dispatchEvent(new Event("detjac-neurons"));
    const r = c.store.run;
    document.getElementById("store-name").textContent = c.store.name;
    document.getElementById("run-info").textContent = (c.graph ? [r.model_id, r.dtype, "attribution graph"]
      : [r.model_id, r.dtype, r.detach === false ? "ordinary" : "detached", r.keep, r.engine,
        `${c.prompts.length} prompts`]).filter(Boolean).join(" · ");
    return c;
  }

  // -- corpus -----------------------------------------------------------------------------------------------------
  const SORTS = {
    line: {label: "file order", key: (r) => r.line ?? 0},
    error: {label: "reconstruction error", key: (r) => r.error ?? Infinity},
    n_tokens: {label: "length (tokens)", key: (r) => r.n_tokens ?? -1},
    next_token: {label: "next token", key: (r) => r.next_token || ""},
    id: {label: "prompt id", key: (r) => r.id},
  };
  const corpusState = {q: "", sort: "line", dir: 1};

  async function showCorpus(gen, focus) {
    setCrumbs("corpus");
    const c = await header();
    if (gen !== generation) return;
    if (c.graph) return showGraphFile(gen, c, focus || []);  // `detjac view graph.json`: the one graph is the page
    const tbody = h("tbody");
    const count = h("span", {class: "note", id: "count"});
    const search = h("input", {type: "search", id: "search", placeholder: "search the prompts' text (or an id)",
      value: corpusState.q, "aria-label": "search"});
    const sort = h("select", {id: "sort", "aria-label": "sort by"},
      Object.entries(SORTS).map(([k, s]) => h("option", {value: k, selected: k === corpusState.sort}, s.label)));
    const dir = h("button", {id: "sort-dir", type: "button"}, corpusState.dir > 0 ? "ascending" : "descending");
    function draw() {
      const q = corpusState.q.toLowerCase();
      const key = SORTS[corpusState.sort].key;
      const rows = c.prompts.filter((r) => !q || r.text.toLowerCase().includes(q) || r.id.startsWith(q));
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        const order = typeof x === "string" ? x.localeCompare(y) : x - y;
        return corpusState.dir * (order || a.id.localeCompare(b.id));
      });
      tbody.replaceChildren(...rows.map((r) => h("tr", {class: "clickable", "data-id": r.id,
        onclick: (e) => { if (e.target.tagName !== "A") location.hash = promptHref(r.id); }},
        h("td", {class: "num"}, r.line ?? ""),
        h("td", {class: "text"}, r.damage ? h("span", {class: "bad damage"}, `DAMAGED: ${r.damage}`)
          : h("a", {href: promptHref(r.id), class: "prompt-link"}, r.text)),
        h("td", {class: "num"}, r.n_tokens ?? ""),
        h("td", {class: "num" + (r.detached === false ? " bad" : "")}, sci(r.error)),
        h("td", {}, h("span", {class: "chip"}, r.next_token)),
        h("td", {class: "note"}, [r.low_rank ? "low-rank" : null, r.layerwise ? `${r.layerwise} layerwise` : null]
          .filter(Boolean).join(", ")),
        h("td", {class: "mono note"}, r.id))));
      count.textContent = `${rows.length} of ${c.prompts.length} prompts`;
    }
    search.addEventListener("input", () => { corpusState.q = search.value; draw(); });
    sort.addEventListener("change", () => { corpusState.sort = sort.value; draw(); });
    dir.addEventListener("click", () => {
      corpusState.dir = -corpusState.dir;
      dir.textContent = corpusState.dir > 0 ? "ascending" : "descending";
      draw();
    });
    draw();
    const r = c.store.run;
    const facts = h("div", {class: "facts-inline"},
      [["model", r.model_id], ["family", r.family || r.model_type], ["dtype", r.dtype], ["kept", r.keep],
        ["Jacobian", r.detach === false ? "ordinary (not detached)" : "detached"], ["engine", r.engine || "in-memory"],
        ["layerwise targets", (r.layerwise || []).length || null], ["created", c.store.created],
        ["detjac", r.detjac_version]]
        .filter(([, v]) => v != null).map(([k, v]) => h("span", {}, h("span", {class: "note"}, k), " ", String(v))));
    const failed = c.failures.length ? panel(`Failed prompts (${c.failures.length})`,
      h("table", {id: "failures"}, h("thead", {}, h("tr", {}, ["line", "prompt", "stage", "error", "reason"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, c.failures.map((f) => h("tr", {"data-id": f.id}, h("td", {class: "num"}, f.line ?? ""),
        h("td", {class: "text"}, f.text), h("td", {}, f.stage), h("td", {}, f.error),
        h("td", {class: "text bad"}, f.reason)))))) : null;
    show(h("h1", {}, "Corpus"), panel(null, facts),
      h("div", {class: "controls"}, search, h("label", {}, "sort by ", sort), dir, count),
      h("table", {id: "corpus"}, h("thead", {}, h("tr", {},
        ["line", "prompt", "tokens", "reconstruction error", "next token", "", "id"].map((t, i) =>
          h("th", {class: [0, 2, 3].includes(i) ? "num" : null}, t)))), tbody),
      failed);
  }

  // -- prompt -----------------------------------------------------------------------------------------------------
  async function showPrompt(gen, id, tab, arg) {
    show(note("Loading the prompt…"));
    header().catch(() => {});
    const p = await load(`prompt/${id}`);
    if (gen !== generation) return;
    setCrumbs(h("a", {href: "#/"}, "corpus"), h("span", {class: "mono"}, id));
    const tabs = h("nav", {class: "tabs", id: "tabs"},
      h("a", {href: promptHref(id), class: tab === "operators" ? "active" : null, "data-tab": "operators"}, "Operators"),
      p.kinds.map((k) => h("a", {href: promptHref(id, "layers", k), "data-tab": `layers/${k}`,
        class: tab === "layers" && arg === k ? "active" : null}, `Layers: ${k}`)),
      p.graph ? h("a", {href: promptHref(id, "graph"), "data-tab": "graph", class: tab === "graph" ? "active" : null},
        "Graph") : null);
    const body = h("div", {id: "tab-body"}, note("Loading…"));
    show(h("h1", {id: "prompt-text", class: "text"}, p.text), tabs, body);
    try {
      if (tab === "layers") await showLayers(gen, p, arg, body);
      else if (tab === "graph") await showGraph(gen, `prompt/${p.id}/graph`, body);
      else await showOperators(gen, p, arg === undefined ? null : arg, body);
    } catch (err) {
      if (gen === generation) body.replaceChildren(h("p", {class: "error", id: "page-error"}, err.message));
    }
  }

  function tokenButtons(p, picked) {
    const go = (k) => { location.hash = k === null ? promptHref(p.id) : promptHref(p.id, "operator", k); };
    return h("div", {class: "tokens", id: "tokens"},
      h("button", {class: "token" + (picked === null ? " picked" : ""), "data-index": "combined", type: "button",
        onclick: () => go(null)}, "all tokens [J₁ … Jₙ]"),
      p.tokens.map((t, k) => h("button", {class: "token" + (picked === k ? " picked" : ""), "data-index": k,
        type: "button", title: `token ${k}, id ${p.token_ids[k]}`, onclick: () => go(k)},
        h("span", {class: "idx"}, k), h("span", {class: "piece"}, t))));
  }

  function predictionPanel(p) {
    const pr = p.prediction;
    if (pr.error) return panel("Prediction", h("p", {class: "error"}, pr.error));
    const maxP = Math.max(...pr.top.map((t) => t.p));
    return panel("Prediction",
      h("p", {}, "next token ", h("span", {class: "chip", id: "next-token"}, p.next_token ?? String(p.next_token_id)),
        h("span", {class: "note"}, ` (id ${p.next_token_id})`)),
      h("table", {id: "probabilities"}, h("tbody", {}, pr.top.map((t) => h("tr", {},
        h("td", {}, h("span", {class: "chip"}, t.text)), h("td", {class: "num"}, t.p.toFixed(4)),
        h("td", {}, (() => { const b = h("span", {class: "bar"}); b.style.width = `${120 * t.p / maxP}px`; return b; })()))))),
      h("p", {class: "note"}, pr.how));
  }

  function errorsPanel(p) {
    const kind = p.detached === false ? "ordinary Jacobian" : "detached Jacobian";
    const rows = [[`output (${kind})`, p.errors.output]];
    for (const [t, e] of Object.entries(p.errors.layerwise)) rows.push([t, e]);
    return panel("Reconstruction error ‖Σₖ Jₖ xₖ − y‖ / ‖y‖",
      h("table", {id: "errors"}, h("tbody", {}, rows.slice(0, 40).map(([name, e]) => h("tr", {},
        h("td", {}, name), h("td", {class: "num"}, sci(e)))))),
      rows.length > 40 ? note(`… and ${rows.length - 40} more layerwise targets (see the layers tabs)`) : null,
      h("dl", {class: "facts"}, [["tokens", p.n_tokens], ["line", p.line], ["dtype", p.dtype],
        ["stored as", p.low_rank ? `rank-${p.rank} triplets` : p.storage_dtype], ["affine", p.affine ? "yes" : null],
        ["written", p.written_at]].filter(([, v]) => v != null).map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])));
  }

  function spectraPanel(p, picked) {
    const s = p.spectra;
    const series = [];
    s.tokens.forEach((t, k) => {
      if (t.S && k !== picked) series.push({name: `J_${k} ${p.tokens[k]}`, y: t.S, color: "#9fb3c8", width: 1, opacity: 0.8});
    });
    if (picked !== null && s.tokens[picked].S) {
      series.push({name: `J_${picked} ${p.tokens[picked]}`, y: s.tokens[picked].S, color: "#e08a00", width: 2.5});
    }
    if (s.combined.S) series.push({name: "[J_1 … J_n]", y: s.combined.S, color: "#16324f", width: 2.5});
    const chart = Charts.line(series, {logY: true, xLabel: "index i", yLabel: "σᵢ", id: "spectra-chart", width: 560,
      label: "singular value spectra"});
    const legend = h("div", {class: "legend"},
      h("span", {}, h("i", {class: "sw-combined"}), "[J₁ … Jₙ]"),
      picked !== null ? h("span", {}, h("i", {class: "sw-picked"}), `J_${picked} (picked)`) : null,
      h("span", {}, h("i", {class: "sw-token"}), "each Jₖ"));
    legend.querySelector(".sw-combined").style.background = "#16324f";
    if (picked !== null) legend.querySelector(".sw-picked").style.background = "#e08a00";
    legend.querySelector(".sw-token").style.background = "#9fb3c8";
    const c = s.combined;
    return panel("Singular value spectra", chart, legend,
      c.error ? h("p", {class: "error"}, c.error) :
        note(`[J₁ … Jₙ]: σ₁ ${num(c.sigma_1)}, stable rank ${num(c.stable_rank, 3)}, n90 ${c.n90}, n99 ${c.n99}` +
          ` (${c.count} values${c.count > c.S.length ? `, the largest ${c.S.length} drawn` : ""}; ${c.source})`));
  }

  function normStrip(p, picked) {
    const sig = p.spectra.tokens.map((t) => t.sigma_1 ?? null);
    const positive = sig.filter((v) => v > 0);
    const lo = Math.min(...positive, 1), hi = Math.max(...positive, 1);
    const shade = (v) => (hi > lo ? Math.log(v / lo) / Math.log(hi / lo) : 1);  // log scale: norms span decades
    const svg = Charts.heatmap([sig], {
      colLabels: p.tokens.map((t, k) => `${k} ${t}`), rowLabels: ["‖Jₖ‖₂"], shade, maxWidth: 1300,
      text: (v) => Charts.short(v), picked, id: "norm-strip", label: "operator norm per token",
      tip: (r, k, v) => `token ${k} ${p.tokens[k]}: ‖J_k‖₂ = σ₁ = ${num(v)}, ‖J_k‖_F = ${num(p.spectra.tokens[k].frobenius)}`,
      onClick: (r, k) => { location.hash = promptHref(p.id, "operator", k); }});
    return panel("Operator norm of each token's Jₖ (σ₁; click a cell)", svg);
  }

  function decodedPanel(p, op, picked) {
    const what = picked === null ? "[J₁ … Jₙ] (all tokens)" : `J_${picked} of token ${JSON.stringify(p.tokens[picked])}`;
    const rows = op.triplets.map((t) => {
      const shares = h("span", {class: "shares", title: "share of |v|² carried by each input token"},
        t.token_shares.map((s, k) => {
          const bar = h("span", {title: `token ${k} ${p.tokens[k]}: ${pct(s)}`});
          bar.style.height = `${Math.max(1, 100 * s)}%`;
          if (k === t.right_token) bar.style.background = "#e08a00";
          return bar;
        }));
      return h("tr", {"data-index": t.index},
        h("td", {class: "num"}, t.index), h("td", {class: "num sigma"}, num(t.sigma, 5)),
        h("td", {class: "left"}, chips(t.left)),
        h("td", {class: "right-token"}, h("span", {class: "mono"}, `[${t.right_token}] `),
          h("span", {class: "note"}, `${p.tokens[t.right_token]} · ${pct(t.right_share)}`),
          t.sink ? h("span", {class: "sink", title: "at least 90% of |v|² on the first token"}, ` · ${t.sink}`) : null),
        h("td", {class: "right"}, chips(t.right)),
        h("td", {}, shares));
    });
    return panel(`Top singular triplets of ${what}, decoded`,
      h("table", {id: "decoded", "data-token": picked === null ? "combined" : picked},
        h("thead", {}, h("tr", {}, ["#", "σ", `left uᵢ → tokens (unembedding, top ${op.top})`, "right vᵢ at token",
          "right vᵢ → tokens (embedding)", "|vᵢ|² by token"].map((t) => h("th", {}, t)))),
        h("tbody", {}, rows)),
      note(op.source));
  }

  function analysesPanel(p) {
    if (!p.analyses.length) return null;
    return panel(`Analyses kept in the store (${p.analyses.length})`,
      h("table", {id: "analyses"}, h("thead", {}, h("tr", {}, ["name", "parameters", "arrays", "σ (first)"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, p.analyses.map((a) => h("tr", {},
        h("td", {class: "mono"}, a.name),
        h("td", {class: "note"}, JSON.stringify(a.attrs.params ?? Object.fromEntries(Object.entries(a.attrs)
          .filter(([k]) => k !== "written_at")))),
        h("td", {class: "note"}, Object.entries(a.arrays).map(([k, s]) => `${k} ${s.join("×")}`).join(", ")),
        h("td", {class: "num"}, a.S ? a.S.slice(0, 5).map((v) => num(v)).join(" ") : ""))))),
      note("Written by detjac analyze; shown as stored, not recomputed."));
  }

  async function showOperators(gen, p, arg, body) {
    const picked = arg === null || arg === "combined" ? null : Number(arg);
    const opPanel = panel(null, note("Computing the singular triplets…"));
    body.replaceChildren(tokenButtons(p, picked), normStrip(p, picked),
      h("div", {class: "row"}, predictionPanel(p), spectraPanel(p, picked), errorsPanel(p)),
      opPanel, analysesPanel(p) || "");
    let op;
    try {
      op = await load(`prompt/${p.id}/operator/${picked === null ? "combined" : picked}`);
    } catch (err) {  // e.g. a store kept without the model's matrices cannot decode: the rest of the page stands
      if (gen === generation) opPanel.replaceWith(panel("Top singular triplets", h("p", {class: "error"}, err.message)));
      return;
    }
    if (gen !== generation) return;
    opPanel.replaceWith(decodedPanel(p, op, picked));
  }

  // -- layers -----------------------------------------------------------------------------------------------------
  async function showLayers(gen, p, kind, body) {
    body.replaceChildren(note(`Computing the ${kind} targets across layers…`));
    const L = await load(`prompt/${p.id}/layers/${kind}`);
    if (gen !== generation) return;
    const x = L.rows.map((r) => r.layer);
    const ticks = x.map((v) => ({at: v, label: String(v)}));
    const rankShade = (v) => 1 - Math.log(v) / Math.log(Math.max(2, ...L.heatmap.u1_rank.flat(), ...L.heatmap.contribution_rank.flat()));
    const heat = (matrix, id, what) => Charts.heatmap(matrix, {
      rowLabels: L.rows.map((r) => r.target), colLabels: L.tokens.map((t, k) => `${k} ${t}`), shade: rankShade,
      text: (v) => String(v), id, label: what, maxWidth: 1300,
      tip: (r, k, v) => `${L.rows[r].target}, token ${k} ${L.tokens[k]}: ${what} rank ${v}`});
    const dims = Charts.line([
      {name: "stable rank", y: L.rows.map((r) => r.stable_rank), x, color: "#2a62b8", marker: true},
      {name: "n90", y: L.rows.map((r) => r.n90), x, color: "#1b7a3a", marker: true, dash: "5 3"},
      {name: "participation ratio", y: L.rows.map((r) => r.participation_ratio), x, color: "#b3261e", marker: true}],
    {xLabel: "layer", yLabel: "dimensions", xTicks: ticks, id: "dims-chart", label: "dimensionality across layers"});
    const ranks = Charts.line([
      {name: "rank in decoded u₁", y: L.rows.map((r) => r.u1_rank), x, color: "#2a62b8", marker: true},
      {name: "rank in the logit lens of the output", y: L.rows.map((r) => r.lens_rank), x, color: "#e08a00", marker: true,
        dash: "5 3"}],
    {logY: true, xLabel: "layer", yLabel: "rank (1 = top)", xTicks: ticks, id: "rank-chart", label: "prediction rank"});
    const legend = (items) => h("div", {class: "legend"}, items.map(([c, t]) => {
      const sw = h("i"); sw.style.background = c; return h("span", {}, sw, t);
    }));
    const table = h("table", {id: "layer-table"},
      h("thead", {}, h("tr", {}, ["target", "σ₁", "stable rank", "n90", "n99", "u₁ rank", "first uᵢ", "lens rank",
        "error", `u₁ → tokens`].map((t) => h("th", {}, t)))),
      h("tbody", {}, L.rows.map((r) => h("tr", {"data-target": r.target},
        h("td", {class: "mono"}, r.target), h("td", {class: "num"}, num(r.sigma_1)),
        h("td", {class: "num"}, num(r.stable_rank, 3)), h("td", {class: "num"}, r.n90), h("td", {class: "num"}, r.n99),
        h("td", {class: "num" + (r.u1_rank <= L.top ? " good" : "")}, r.u1_rank),
        h("td", {class: "num"}, r.first_sv || "–"), h("td", {class: "num"}, r.lens_rank),
        h("td", {class: "num"}, sci(r.error)), h("td", {}, chips(r.u1_tokens.slice(0, 8)))))));
    body.replaceChildren(
      h("p", {}, "Tracking the predicted next token ", h("span", {class: "chip", id: "tracked"}, L.token.text),
        h("span", {class: "note"}, ` over the ${L.rows.length} stored ${kind}.L targets (as detjac analyze layers).`)),
      panel(`Rank of ${L.token.text} in each Jₖ's decoded u₁ (layer × token; 1 = top)`,
        heat(L.heatmap.u1_rank, "layers-heatmap", "u₁")),
      panel(`Rank of ${L.token.text} in each token's decoded contribution Jₖ xₖ (layer × token)`,
        heat(L.heatmap.contribution_rank, "contribution-heatmap", "contribution")),
      h("div", {class: "row"},
        panel("Dimensionality of [J₁ … Jₙ] across layers", dims,
          legend([["#2a62b8", "stable rank ‖J‖²_F/σ₁²"], ["#1b7a3a", "n90"], ["#b3261e", "participation ratio"]])),
        panel("Rank of the prediction per layer", ranks,
          legend([["#2a62b8", "in decoded u₁ of [J₁ … Jₙ]"], ["#e08a00", "in the logit lens of the output"]]))),
      panel(`Per layer (top ${L.top} decoded tokens; u₁ among the first ${L.k} singular vectors)`, table));
  }

  // -- graph ------------------------------------------------------------------------------------------------------
  async function showGraph(gen, key, body, focus) {
    body.replaceChildren(note("Loading the graph…"));
    const g = await load(key);
    if (gen !== generation) return;
    GraphPage.show(body, g, focus ? AttentionPage.graphFocus(g, focus) : {});
  }

  async function showGraphFile(gen, c, focus) {
    setCrumbs(focus.length ? h("a", {href: "#/"}, "graph") : "graph");
    const body = h("div", {id: "tab-body"}, note("Loading the graph…"));
    show(h("h1", {}, "Attribution graph of ", h("span", {id: "prompt-text", class: "text"}, "")), body);
    const g = await load(c.graph);
    if (gen !== generation) return;
    document.getElementById("prompt-text").textContent = g.metadata.prompt;
    await showGraph(gen, c.graph, body, focus);
  }

  async function showAttention(gen, name) {  // a head's page (`detjac view graph.json --attention qk.json`)
    show(note("Loading the attention page…"));
    header().catch(() => {});
    const qk = await load(`attention/${name}`);  // with what it needs of the graph: never the graph's links
    if (gen !== generation) return;
    setCrumbs(h("a", {href: "#/"}, "graph"), h("span", {class: "mono"}, `head ${qk.layer}.${qk.head}`));
    show(h("div", {id: "attention-page"}));
    AttentionPage.show(document.getElementById("attention-page"), qk);
  }

  // -- routing ----------------------------------------------------------------------------------------------------
  function route() {
    const gen = ++generation;
    const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
    const done = parts[0] === "prompt" && parts[1]
      ? showPrompt(gen, parts[1], ["layers", "graph"].includes(parts[2]) ? parts[2] : "operators", parts[3])
      : parts[0] === "attention" && parts[1] ? showAttention(gen, parts[1])
        : showCorpus(gen, parts[0] === "graph" ? parts.slice(1) : null);
    done.then(() => { if (gen === generation) document.body.dataset.ready = String(gen); })
      .catch((err) => { if (gen === generation) { fail(err); document.body.dataset.ready = String(gen); } });
  }
  window.addEventListener("hashchange", route);
  route();
})();
