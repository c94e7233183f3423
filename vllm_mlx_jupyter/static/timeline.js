// SchedulerTimeline view (anywidget ES module; no build step, no network).
// Python sends only the steps not sent before (see views/timeline.py); this view appends them as
// columns, keeps at most `max_columns`, and shows a step's details on hover, here in the
// browser, because Python callbacks wait while a cell is busy.

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
  "#b07aa1", "#ff9da7", "#9c755f", "#17becf", "#bcbd22", "#8c564b"]; // as in inspector.js
const BAR_PX = 80; // a full token budget
const TIME_PX = 24; // the slowest step in view

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function colorOf(slot) { return PALETTE[slot % PALETTE.length]; }

function skeleton(el) {
  el.classList.add("vmt");
  const head = h("div", "vmt-head");
  const engine = h("span", "vmt-engine");
  head.append(h("span", "vmt-title", "Scheduler timeline"), engine);
  const legend = h("div", "vmt-legend");
  for (const [cls, label] of [["prefill", "prefill tokens"], ["decode", "decode tokens"],
    ["preempt", "preempted"], ["resume", "resumed"], ["hit", "prefix hit"]]) {
    const item = h("span", "vmt-legend-item");
    item.append(h("span", `vmt-swatch vmt-sw-${cls}`), document.createTextNode(label));
    legend.append(item);
  }
  const scroll = h("div", "vmt-scroll");
  const columns = h("div", "vmt-columns");
  scroll.append(columns);
  const parts = { engine, stats: h("div", "vmt-stats"), legend, scroll, columns, tip: h("div", "vmt-tip") };
  parts.tip.hidden = true;
  el.append(head, parts.stats, legend, scroll, parts.tip);
  return parts;
}

// One step's column: markers on top, the stacked tokens (first request at the bottom), the
// budget line, then the step time below.
function column(step, slowest) {
  const col = h("div", "vmt-col");
  col.dataset.step = String(step.step);
  const marks = h("div", "vmt-marks");
  if (step.preempted.length) marks.append(h("div", "vmt-mark vmt-sw-preempt"));
  if (step.resumed.length) marks.append(h("div", "vmt-mark vmt-sw-resume"));
  if (Object.keys(step.hits).length) marks.append(h("div", "vmt-mark vmt-sw-hit"));
  const bar = h("div", "vmt-bar");
  bar.style.height = `${BAR_PX}px`;
  const budget = Math.max(step.budget, step.used, 1);
  for (const q of step.reqs) {
    for (const [kind, tokens] of [["prefill", q.prefill], ["decode", q.decode]]) {
      if (!tokens) continue;
      const seg = h("div", `vmt-seg vmt-${kind}`);
      seg.style.height = `${Math.max(2, (tokens / budget) * BAR_PX)}px`; // a decode token stays visible
      seg.style.backgroundColor = colorOf(q.color);
      bar.append(seg);
    }
  }
  const time = h("div", "vmt-time");
  time.style.height = `${Math.max(1, (step.ms / slowest) * TIME_PX)}px`;
  col.append(marks, bar, time);
  return col;
}

function details(step) {
  const lines = [[`Step ${step.step}`, "vmt-tip-title"],
    [`${step.used} of ${step.budget} tokens · ${step.ms.toFixed(1)} ms · ${step.calls} forward call${step.calls === 1 ? "" : "s"}`]];
  for (const q of step.reqs) {
    const what = q.proposed ? `decode 1 token, verify ${q.proposed} proposed: ${q.accepted} kept`
      : q.decode ? "decode 1 token"
      : q.start < q.prompt ? `prefill ${q.prefill} tokens (${q.start}–${q.start + q.prefill} of a ${q.prompt}-token prompt)`
        : `recompute ${q.prefill} tokens`;
    lines.push([`${q.id}: ${what}`, "", q.color]);
  }
  for (const [id, cached] of Object.entries(step.hits)) lines.push([`prefix hit: ${id} (${cached} tokens cached)`]);
  for (const id of step.resumed) lines.push([`resumed: ${id}`]);
  for (const p of step.preempted) lines.push([`preempted: ${p.id}`, "", p.color]);
  return lines;
}

function render({ model, el }) {
  const ui = skeleton(el);
  let steps = []; // what the columns show, oldest first
  let epoch = model.get("epoch");
  let slowest = 1e-6;

  function paintStats() {
    const state = model.get("engine_state");
    ui.engine.textContent = state === "running" ? "" : state;
    if (!steps.length) { ui.stats.textContent = "no steps yet"; return; }
    const n = steps.length;
    const used = steps.reduce((a, s) => a + s.used, 0) / n;
    const ms = steps.reduce((a, s) => a + s.ms, 0) / n;
    const pre = steps.reduce((a, s) => a + s.preempted.length, 0);
    const hits = steps.reduce((a, s) => a + Object.keys(s.hits).length, 0);
    ui.stats.textContent = [`steps ${steps[0].step}–${steps[n - 1].step}`,
      `budget used ${used.toFixed(1)} / ${steps[n - 1].budget} tokens`, `${ms.toFixed(1)} ms per step`,
      `preemptions ${pre}`, `prefix hits ${hits}`].join(" · ");
  }

  function append(batch) {
    const last = steps.length ? steps[steps.length - 1].step : 0;
    const fresh = batch.filter((s) => s.step > last);
    if (!fresh.length) return;
    const atEnd = ui.scroll.scrollLeft + ui.scroll.clientWidth >= ui.scroll.scrollWidth - 4;
    const before = slowest;
    for (const s of fresh) slowest = Math.max(slowest, s.ms);
    steps = steps.concat(fresh).slice(-model.get("max_columns"));
    for (const s of fresh) ui.columns.append(column(s, slowest));
    while (ui.columns.children.length > steps.length) ui.columns.firstChild.remove();
    if (slowest !== before) { // columns and steps now pair up: rescale the step-time row
      Array.from(ui.columns.children).forEach((col, i) => {
        col.lastChild.style.height = `${Math.max(1, (steps[i].ms / slowest) * TIME_PX)}px`;
      });
    }
    if (atEnd) ui.scroll.scrollLeft = ui.scroll.scrollWidth; // follow live unless scrolled back
    paintStats();
  }

  function onRecords() {
    if (model.get("epoch") !== epoch) { // a new engine: start over
      epoch = model.get("epoch");
      steps = [];
      slowest = 1e-6;
      ui.columns.replaceChildren();
    }
    append(model.get("records") || []);
    paintStats();
  }

  ui.columns.addEventListener("mouseover", (event) => {
    const col = event.target.closest(".vmt-col");
    const step = col && steps.find((s) => String(s.step) === col.dataset.step);
    if (!step) return;
    ui.tip.replaceChildren(...details(step).map(([text, cls, color]) => {
      const line = h("div", cls || "", text);
      if (color !== undefined) {
        const swatch = h("span", "vmt-swatch");
        swatch.style.backgroundColor = colorOf(color);
        line.prepend(swatch);
      }
      return line;
    }));
    const r = col.getBoundingClientRect();
    const e = el.getBoundingClientRect();
    ui.tip.style.left = `${Math.max(0, Math.min(r.right - e.left + 6, e.width - 280))}px`;
    ui.tip.style.top = `${r.top - e.top}px`;
    ui.tip.hidden = false;
  });
  ui.columns.addEventListener("mouseleave", () => { ui.tip.hidden = true; });

  model.on("change:records", onRecords);
  model.on("change:epoch", onRecords);
  model.on("change:engine_state", paintStats);
  onRecords();
  return () => {
    model.off("change:records", onRecords);
    model.off("change:epoch", onRecords);
    model.off("change:engine_state", paintStats);
  };
}

export default { render };
