// detjac view: the two element makers every script of the page uses. Text is only ever set as text (textContent,
// text nodes), so text from a store or a graph is never parsed as markup.
"use strict";

const Dom = (() => {
  const NS = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, text) {  // an SVG element with attributes and, optionally, its text
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v != null) e.setAttribute(k, String(v));
    if (text != null) e.textContent = String(text);
    return e;
  }

  function h(tag, attrs, ...children) {  // an HTML element: attributes, on* listeners, children (nodes or text)
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) if (c != null && c !== false) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  return {svg, h};
})();
