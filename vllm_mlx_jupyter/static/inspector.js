// CacheInspector view (anywidget ES module; no build step, no network).
// State comes from Python (see views/inspector.py); hover, selection and highlighting live here so
// they stay responsive while a cell is busy. Python only hears "paused" and "reset".

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
  "#b07aa1", "#ff9da7", "#9c755f", "#17becf", "#bcbd22", "#8c564b"];
const STATES = ["null", "free", "cached", "used"];
const STATE_LABELS = { null: "null (reserved)", free: "free", cached: "cached (evictable prefix)", used: "in use" };

function bytesOf(value) {
  if (!value) return new Uint8Array(0);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  return new Uint8Array(0);
}

function typed(value, Type) {
  const copy = bytesOf(value).slice(); // aligned copy
  return new Type(copy.buffer, 0, Math.floor(copy.byteLength / Type.BYTES_PER_ELEMENT));
}

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function pct(x) { return `${Math.round((x || 0) * 100)}%`; }

function decode(model) {
  return {
    numBlocks: model.get("num_blocks"),
    blockSize: model.get("block_size"),
    state: bytesOf(model.get("block_state")),
    ref: bytesOf(model.get("block_ref")),
    owner: typed(model.get("block_owner"), Int32Array),
    tokens: typed(model.get("block_tokens"), Uint16Array),
    evict: typed(model.get("block_evict"), Int32Array),
    disk: bytesOf(model.get("block_disk")),
    tables: typed(model.get("block_tables"), Int32Array),
    info: model.get("block_info") || {},
    requests: model.get("requests") || [],
    stats: model.get("stats") || {},
    mllm: model.get("mllm") || [],
    groups: model.get("kv_groups") || [],
    engine: model.get("engine_state"),
  };
}

function skeleton(el) {
  el.classList.add("vmi");
  const head = h("div", "vmi-head");
  const engine = h("span", "vmi-engine");
  head.append(h("span", "vmi-title", "KV cache"), engine, h("span", "vmi-spacer"));
  const pause = h("button", "vmi-pause", "Pause");
  const reset = h("button", "vmi-reset", "Reset prefix cache");
  reset.title = "forget the hashes of unreferenced blocks";
  head.append(pause, reset);
  const legend = h("div", "vmi-legend");
  for (const [cls, label] of [["free", "free"], ["cached", "cached (evictable)"], ["used", "in use (colour per request)"], ["shared", "shared (ref count)"], ["disk", "read from disk (corner)"]]) {
    const item = h("span", "vmi-legend-item");
    item.append(h("span", `vmi-swatch vmi-${cls}`), document.createTextNode(label));
    legend.append(item);
  }
  const table = h("table", "vmi-requests");
  const header = h("tr");
  for (const name of ["request", "status", "prompt", "cached", "generated", "blocks"]) header.append(h("th", "", name));
  table.append(h("thead"), h("tbody"));
  table.tHead.append(header);
  const mllm = h("div", "vmi-mllm");
  mllm.append(h("div", "vmi-subtitle", "Multimodal cache"), h("div", "vmi-mllm-body"));
  const parts = {
    head, engine, pause, reset, legend, table, mllm,
    stats: h("div", "vmi-stats"), groups: h("div", "vmi-groups"), grid: h("div", "vmi-grid"), note: h("div", "vmi-note"), tip: h("div", "vmi-tip"),
  };
  parts.tip.hidden = true;
  el.append(head, parts.stats, parts.groups, legend, parts.grid, parts.note, h("div", "vmi-subtitle", "Requests"), table, mllm, parts.tip);
  return parts;
}

function ownersOf(data) {
  const owners = new Map();
  data.requests.forEach((r) => {
    for (let k = r.offset; k < r.offset + r.num_blocks; k++) {
      const id = data.tables[k];
      if (!owners.has(id)) owners.set(id, []);
      owners.get(id).push(r.name);
    }
  });
  return owners;
}

function render({ model, el }) {
  const ui = skeleton(el);
  let data = decode(model);
  let owners = ownersOf(data);
  let selected = null; // request id whose block table is highlighted
  let frozen = !!model.get("paused");

  function selectedBlocks() {
    const r = data.requests.find((x) => x.id === selected);
    if (!r) return null;
    return new Set(data.tables.subarray(r.offset, r.offset + r.num_blocks));
  }

  function paintGrid() {
    const n = data.state.length;
    const grid = ui.grid;
    grid.classList.toggle("vmi-dense", n > 1024);
    grid.classList.toggle("vmi-tiny", n > 4096);
    while (grid.children.length < n) {
      const cell = h("div", "vmi-block");
      cell.dataset.id = String(grid.children.length);
      grid.append(cell);
    }
    while (grid.children.length > n) grid.lastChild.remove();
    const hl = selectedBlocks();
    for (let i = 0; i < n; i++) {
      const cell = grid.children[i];
      const state = STATES[data.state[i]] || "free";
      const ref = data.ref[i];
      let cls = `vmi-block vmi-${state}`;
      if (ref > 1) cls += " vmi-shared";
      if (data.disk[i]) cls += " vmi-disk";
      if (hl) cls += hl.has(i) ? " vmi-hl" : " vmi-dim";
      if (cell.className !== cls) cell.className = cls;
      const owner = data.owner[i];
      const color = state === "used" && owner >= 0 && data.requests[owner] ? PALETTE[data.requests[owner].color % PALETTE.length] : "";
      if (cell.style.backgroundColor !== color) cell.style.backgroundColor = color;
      const label = ref > 1 ? String(ref) : "";
      if (cell.textContent !== label) cell.textContent = label;
      cell.dataset.state = state;
    }
    ui.note.textContent = data.numBlocks > n ? `showing ${n} of ${data.numBlocks} blocks` : "";
  }

  function paintStats() {
    const s = data.stats;
    ui.engine.textContent = data.engine === "running" ? `${data.numBlocks} blocks × ${data.blockSize} tokens` : data.engine;
    ui.stats.textContent = [
      `usage ${pct(s.usage)}`, `used ${s.num_used_blocks ?? 0}`, `cached ${s.num_cached_free_blocks ?? 0}`,
      `free ${s.num_free_blocks ?? 0}`, `hit rate ${pct(s.hit_rate)}`, `tokens saved ${s.tokens_saved ?? 0}`,
      `evictions ${s.evictions ?? 0}`, `running ${s.running ?? 0}`, `waiting ${s.waiting ?? 0}`,
    ].join(" · ");
    ui.groups.replaceChildren(...data.groups.map((g) => h("div", "vmi-group", g.label)));
    ui.pause.textContent = frozen ? "Resume" : "Pause";
    el.classList.toggle("vmi-paused", frozen);
  }

  function paintTable() {
    const body = ui.table.tBodies[0];
    body.replaceChildren();
    for (const r of data.requests) {
      const row = h("tr", r.id === selected ? "vmi-selected" : "");
      row.dataset.id = r.id;
      const name = h("td", "vmi-name");
      const sw = h("span", "vmi-swatch");
      sw.style.backgroundColor = PALETTE[r.color % PALETTE.length];
      name.append(sw, document.createTextNode(r.adapter ? `${r.name} · ${r.adapter}` : r.name));
      row.append(name, h("td", `vmi-status vmi-st-${r.status}`, r.status), h("td", "", String(r.prompt_tokens)),
        h("td", "", r.disk_tokens ? `${r.cached_tokens} (${r.disk_tokens} from disk)` : String(r.cached_tokens)),
        h("td", "", String(r.output_tokens)), h("td", "", String(r.num_blocks)));
      body.append(row);
    }
    if (!data.requests.length) {
      const row = h("tr");
      const cell = h("td", "vmi-empty", "no requests yet");
      cell.colSpan = 6;
      row.append(cell);
      body.append(row);
    }
  }

  let mllmKey = null;
  function paintMllm() {
    const key = JSON.stringify(data.mllm);
    if (key === mllmKey) return; // thumbnails: repaint only on change
    mllmKey = key;
    const box = ui.mllm.querySelector(".vmi-mllm-body");
    box.replaceChildren();
    if (!data.mllm.length) {
      box.append(h("div", "vmi-empty", "No multimodal cache entries."));
      return;
    }
    for (const e of data.mllm) {
      const item = h("div", "vmi-mllm-entry");
      if (e.thumbnail_base64) {
        const img = h("img");
        img.src = `data:image/png;base64,${e.thumbnail_base64}`;
        item.append(img);
      }
      const size = e.width && e.height ? `${e.width}×${e.height}` : "";
      item.append(h("div", "", [e.hash, size, `${e.num_tokens ?? "?"} tokens`, `hits ${e.hits ?? 0}`].filter(Boolean).join(" · ")));
      box.append(item);
    }
  }

  function paint() {
    paintStats();
    paintGrid();
    paintTable();
    paintMllm();
  }

  function showTip(cell) {
    const i = Number(cell.dataset.id);
    const state = STATES[data.state[i]] || "free";
    const [hash, text] = data.info[String(i)] || ["", ""];
    const lines = [`Block ${i} · ${STATE_LABELS[state]}`, `ref count ${data.ref[i]} · ${data.tokens[i]}/${data.blockSize} tokens`];
    if (hash) lines.push(`hash ${hash}`);
    const who = owners.get(i);
    if (who && who.length) lines.push(`owners: ${who.join(", ")}`);
    if (data.evict[i] >= 0) lines.push(`eviction order: #${data.evict[i] + 1}`);
    if (data.disk[i]) lines.push("KV read back from disk, not computed");
    ui.tip.replaceChildren(...lines.map((l, k) => h("div", k === 0 ? "vmi-tip-title" : "", l)));
    if (text) ui.tip.append(h("pre", "vmi-tip-text", text));
    const r = cell.getBoundingClientRect();
    const e = el.getBoundingClientRect();
    ui.tip.style.left = `${r.right - e.left + 6}px`;
    ui.tip.style.top = `${r.top - e.top}px`;
    ui.tip.hidden = false;
  }

  ui.grid.addEventListener("mouseover", (event) => {
    const cell = event.target.closest(".vmi-block");
    if (cell) showTip(cell);
  });
  ui.grid.addEventListener("mouseleave", () => { ui.tip.hidden = true; });
  ui.table.addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-id]");
    if (!row) return;
    selected = selected === row.dataset.id ? null : row.dataset.id;
    paintGrid();
    paintTable();
  });
  ui.pause.addEventListener("click", () => {
    frozen = !frozen;
    model.set("paused", frozen);
    model.save_changes();
    if (!frozen) { data = decode(model); owners = ownersOf(data); paint(); } else paintStats();
  });
  ui.reset.addEventListener("click", () => model.send({ type: "reset" }));

  let scheduled = false;
  const onChange = () => {
    if (frozen || scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      data = decode(model);
      owners = ownersOf(data);
      paint();
    });
  };
  model.on("change", onChange);
  paint();
  return () => model.off("change", onChange);
}

export default { render };
