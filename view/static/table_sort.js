// detjac view: a table sorted by any column: a click on a header sorts the rows by that column's values, again in the
// other direction. Each sortable cell carries its value in `data-value` (a number where the column is numeric); a
// numeric column sorts largest first on its first click, a text column A to Z. The header says its direction in
// `aria-sort`. Rows are moved, never rebuilt: their text stays as it was set (as text).
"use strict";

const TableSort = (() => {
  function value(row, col) {  // undefined for a cell without a value (a number column's "–")
    const cell = row.cells[col];
    return cell ? cell.dataset.value : undefined;
  }

  function compare(a, b, numeric) {
    if (!numeric) return String(a ?? "").localeCompare(String(b ?? ""));
    const x = Number(a), y = Number(b);  // a cell without a number ("–") sorts last either way
    if (Number.isNaN(x) || Number.isNaN(y)) return Number.isNaN(x) - Number.isNaN(y);
    return x - y;
  }

  // Make `table`'s headers sort its body: `numeric[i]` says whether column i holds numbers, null if it is not
  // sortable. Returns the table.
  function sortable(table, numeric) {
    const headers = [...table.tHead.rows[0].cells];
    headers.forEach((th, col) => {
      if (numeric[col] == null) return;
      th.classList.add("sortable");
      th.setAttribute("tabindex", "0");
      th.setAttribute("title", "sort by this column (again: the other way)");
      const sort = () => {
        const ascending = th.getAttribute("aria-sort") ? th.getAttribute("aria-sort") === "descending"
          : !numeric[col];
        for (const other of headers) other.removeAttribute("aria-sort");
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        const body = table.tBodies[0];
        const rows = [...body.rows];
        const sign = ascending ? 1 : -1;
        const nan = (r) => numeric[col] && Number.isNaN(Number(value(r, col)));
        rows.sort((a, b) => (nan(a) || nan(b) ? compare(value(a, col), value(b, col), true)
          : sign * compare(value(a, col), value(b, col), numeric[col])));
        body.append(...rows);
      };
      th.addEventListener("click", sort);
      th.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sort(); } });
    });
    return table;
  }

  return {sortable};
})();
