// The run inspector page: reads the read-only JSON API of ui/server.py and draws with uPlot.
// Every logged string is put into the page with textContent (never as HTML): a response holding <script> is text.
// Charts are made once and then given new data in place (a zoom survives a refresh); each is sized from its own cell.
"use strict";

const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
const STAGE_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#e15759", "#9c755f", "#bab0ac"];
const ROLLOUT_COLOUR = "#2f4b7c";  // the second stream of a rollout of its own
const PREFS_KEY = "ppoflow-inspector";
const state = {
  settings: null, runs: [], colours: new Map(), selected: new Set(), userSelected: false, sort: { key: "start_time", desc: true },
  curveData: {}, timelineData: [], charts: new Map(), timelines: new Map(), metricKeys: [], samples: [],
  drawnVersion: null, queue: Promise.resolve(), prefs: JSON.parse(localStorage.getItem(PREFS_KEY) || "{}"),
};

// ------------------------------------------------------------------ helpers
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "text") node.textContent = value;
    else if (key === "className") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function api(path, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    for (const item of [].concat(value)) query.append(key, item);
  }
  const response = await fetch(`/api/${path}?${query}`);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function status(message, isError = false) {
  const node = document.getElementById("status");
  node.textContent = message;
  node.className = isError ? "error" : "hint";
}

function savePrefs() {
  localStorage.setItem(PREFS_KEY, JSON.stringify(state.prefs));
}

function runById(runId) {
  return state.runs.find((r) => r.run_id === runId);
}

function runLabel(runId) {
  const run = runById(runId);
  return run ? `${run.name} (${runId.slice(0, 6)})` : runId.slice(0, 8);
}

function colourOf(runId) {
  return state.colours.get(runId) || COLOURS[0];
}

function formatNumber(value, digits = 3) {
  return value === null || value === undefined ? "" : Number(value).toFixed(digits);
}

function formatDuration(ms) {
  if (ms === null || ms === undefined || ms < 0) return "";
  const seconds = Math.round(ms / 1000);
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  return h ? `${h} h ${m} min` : m ? `${m} min ${s} s` : `${s} s`;
}

function orderedSelected() {
  return state.runs.filter((r) => state.selected.has(r.run_id)).map((r) => r.run_id);
}

// ------------------------------------------------------------------ runs
function mlflowRunUrl(run) {
  // the model-training view: without it a fresh browser opens MLflow 3's GenAI view, with no params or metrics
  return `${state.settings.mlflow_url}/#/experiments/${run.experiment_id}/runs/${run.run_id}?workflowType=machine_learning`;
}

function duration(run) {
  return run.start_time ? (run.end_time || Date.now()) - run.start_time : null;
}

function sortValue(run, key) {
  return key === "duration" ? duration(run) : run[key];
}

function sortedRuns(runs) {
  const { key, desc } = state.sort;
  return [...runs].sort((a, b) => {
    const x = sortValue(a, key), y = sortValue(b, key);
    if (x === y) return 0;
    if (x === null || x === undefined) return 1;  // runs without the value go last either way
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * (desc ? -1 : 1);
  });
}

function runRows() {
  // sweep children right under their parent (sorted among themselves), everything else sorted at the top level
  const present = new Set(state.runs.map((r) => r.run_id));
  const children = new Map();
  const top = [];
  for (const run of state.runs) {
    if (run.parent_run_id && present.has(run.parent_run_id)) {
      if (!children.has(run.parent_run_id)) children.set(run.parent_run_id, []);
      children.get(run.parent_run_id).push(run);
    } else top.push(run);
  }
  return sortedRuns(top).flatMap((run) => [{ run, depth: 0 }, ...sortedRuns(children.get(run.run_id) || []).map((c) => ({ run: c, depth: 1 }))]);
}

function renderRuns() {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  const empty = document.getElementById("runs-empty");
  empty.hidden = state.runs.length > 0;
  empty.textContent = `No runs in experiment "${document.getElementById("experiment").value || state.settings.default_experiment}" yet: start one with "ppoflow train".`;
  document.getElementById("runs").hidden = !state.runs.length;
  for (const th of document.querySelectorAll("#runs th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort.key);
    th.dataset.direction = th.dataset.sort === state.sort.key ? (state.sort.desc ? "▼" : "▲") : "";
  }
  for (const { run, depth } of runRows()) {
    const box = el("input", { type: "checkbox" });
    box.checked = state.selected.has(run.run_id);
    box.addEventListener("change", () => {
      if (box.checked) state.selected.add(run.run_id); else state.selected.delete(run.run_id);
      state.userSelected = true;
      refreshSelection();
    });
    const links = el("td");
    if (state.settings.mlflow_url) links.append(el("a", { href: mlflowRunUrl(run), target: "_blank", rel: "noopener", text: "MLflow" }), " ");
    if (run.prefect_url) links.append(el("a", { href: run.prefect_url, target: "_blank", rel: "noopener", text: "Prefect" }));
    const swatch = el("span", { className: "swatch", text: "■ " });
    swatch.style.color = colourOf(run.run_id);
    const validation = el("td", { className: "num", text: formatNumber(run.validation) });
    if (run.validation_key) validation.title = run.validation_key;
    body.append(el("tr", { "data-run-id": run.run_id, className: depth ? "child" : "" },
      el("td", {}, box), el("td", {}, swatch, run.name || run.run_id), el("td", { text: run.status }),
      el("td", { text: run.algorithm }), el("td", { text: run.model }), el("td", { className: "num", text: String(run.step) }),
      el("td", { className: "num", text: formatNumber(run.score) }), validation,
      el("td", { text: run.start_time ? new Date(run.start_time).toLocaleString() : "" }),
      el("td", { className: "num", text: formatDuration(duration(run)) }), links));
  }
}

function defaultSelection() {
  // the newest run that has something to show (a step, or it ended); while every run is starting, the newest
  const shown = state.runs.find((r) => r.step > 0 || r.status !== "RUNNING") || state.runs[0];
  return shown ? [shown.run_id] : [];
}

async function loadRuns() {
  const experiment = document.getElementById("experiment").value || state.settings.default_experiment;
  state.runs = await api("runs", { experiment });
  // a run keeps its colour: colours go by start order, so a new run takes the next one and the others keep theirs
  const byStart = [...state.runs].sort((a, b) => a.start_time - b.start_time || a.run_id.localeCompare(b.run_id));
  state.colours = new Map(byStart.map((run, i) => [run.run_id, COLOURS[i % COLOURS.length]]));
  for (const runId of [...state.selected]) if (!runById(runId)) state.selected.delete(runId);
  if (!state.userSelected && state.selected.size === 0) defaultSelection().forEach((id) => state.selected.add(id));
  renderRuns();
}

// ------------------------------------------------------------------ charts (made once, then given data in place)
function alignSeries(series) {
  // uPlot wants one shared x axis: the union of the series' x values, with nulls where a series has no point
  const xs = [...new Set(series.flatMap((s) => s.x))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const columns = series.map((s) => {
    const column = new Array(xs.length).fill(null);
    s.x.forEach((x, i) => { column[index.get(x)] = s.values[i]; });
    return column;
  });
  return [xs, ...columns];
}

const STEP_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

function upsertChart(registry, container, id, title, make, data) {
  // the chart `id` of `registry`: made by `make()` (uPlot options) when new or when its series changed, else given
  // `data` in place, keeping a zoom the user made (drag) until they double-click
  const options = make();
  const signature = JSON.stringify([title, options.series.map((s) => [s.label, s.stroke]), options.kind]);
  let entry = registry.get(id);
  if (entry && entry.signature !== signature) {
    entry.destroy();
    entry = null;
  }
  if (!entry) {
    const box = el("div", { className: "chart", "data-title": title }, el("h3", { text: title }));
    container.append(box);
    entry = { box, signature, zoomed: false };
    options.width = Math.max(200, Math.floor(box.clientWidth) || 400);
    options.hooks = { setSelect: [(u) => { if (u.select.width > 0) entry.zoomed = true; }] };
    entry.chart = new uPlot(options, data, box);
    entry.chart.over.addEventListener("dblclick", () => { entry.zoomed = false; });
    box.uplot = entry.chart;  // the page tests read the chart through its box
    entry.observer = new ResizeObserver(() => {
      const width = Math.floor(box.clientWidth);
      if (width > 0 && Math.abs(width - entry.chart.width) > 1) entry.chart.setSize({ width, height: entry.chart.height });
    });
    entry.observer.observe(box);
    entry.destroy = () => { entry.observer.disconnect(); entry.chart.destroy(); box.remove(); };
    registry.set(id, entry);
  } else {
    entry.chart.setData(data, !entry.zoomed);
  }
  container.append(entry.box);  // keeps the boxes in the order they are drawn
  return entry;
}

function dropCharts(registry, keep) {
  for (const [id, entry] of registry) {
    if (!keep.has(id)) {
      entry.destroy();
      registry.delete(id);
    }
  }
}

function placeholder(container, id, title, text) {
  let box = container.querySelector(`.placeholder[data-id="${CSS.escape(id)}"]`);
  if (!box) box = el("div", { className: "chart placeholder", "data-id": id, "data-title": title }, el("h3", { text: title }), el("p", { className: "hint", text }));
  container.append(box);
}

// ------------------------------------------------------------------ curves
function ema(values, weight) {
  // TensorBoard's debiased EMA over the finite points: m_t = w m_(t-1) + (1 - w) v_t, shown as m_t / (1 - w^n)
  if (!weight) return values;
  let mean = 0, n = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return v;
    mean = weight * mean + (1 - weight) * v;
    n += 1;
    return mean / (1 - weight ** n);
  });
}

function xValues(line, axis) {
  if (axis === "relative") return line.times.map((t) => (t - line.start_time) / 1000);
  if (axis === "wall") return line.times.map((t) => t / 1000);
  return line.steps;
}

function curveOptions(title, series, axis, log) {
  const xLabel = { step: "step", relative: "seconds since the run started", wall: "" }[axis];
  return {
    kind: `${axis}:${log}`, height: 220,
    scales: { x: { time: axis === "wall" }, y: log ? { distr: 3 } : {} },
    cursor: { sync: { key: "ppoflow-curves" } },
    series: [{ label: xLabel || "time" }, ...series.map((s) => ({ label: s.label, stroke: s.colour, width: 1.5, spanGaps: true }))],
    axes: [axis === "step" ? { label: xLabel, incrs: STEP_TICKS } : { label: xLabel }, {}],
  };
}

function drawCurves() {
  const container = document.getElementById("curves");
  const runIds = orderedSelected();
  const axis = document.getElementById("x-axis").value;
  const log = document.getElementById("log-scale").checked;
  const weight = parseFloat(document.getElementById("smoothing").value) || 0;
  document.getElementById("smoothing-value").textContent = weight.toFixed(2);
  const keep = new Set();
  container.querySelectorAll(".placeholder").forEach((node) => node.remove());
  if (!runIds.length) placeholder(container, "none", "no run selected", "Tick a run in the list above to see its curves.");
  for (const [name, lines] of Object.entries(state.curveData)) {
    if (!lines.length) {
      placeholder(container, name, name, "not logged by the selected runs");
      continue;
    }
    const series = lines.map((line) => ({
      label: runIds.length > 1 || lines.length > 1 ? `${runLabel(line.run_id)} ${line.key}` : line.key,
      colour: colourOf(line.run_id), x: xValues(line, axis),
      values: ema(line.values, weight).map((v) => (log && !(v > 0) ? null : v)),
    }));
    keep.add(name);
    upsertChart(state.charts, container, name, name, () => curveOptions(name, series, axis, log), alignSeries(series));
  }
  dropCharts(state.charts, keep);
}

async function loadCurves() {
  const runIds = orderedSelected();
  state.curveData = runIds.length ? await api("curves", { run: runIds, key: state.prefs.metrics || [], max_points: 1000 }) : {};
  drawCurves();
}

// ------------------------------------------------------------------ metric picker
function renderMetricPicker() {
  const chosen = new Set(state.prefs.metrics || []);
  const needle = document.getElementById("metric-search").value.toLowerCase();
  const groups = new Map();
  for (const key of state.metricKeys) {
    if (needle && !key.toLowerCase().includes(needle)) continue;
    const prefix = key.includes("/") ? key.slice(0, key.indexOf("/")) : "(other)";
    if (!groups.has(prefix)) groups.set(prefix, []);
    groups.get(prefix).push(key);
  }
  const holder = document.getElementById("metric-groups");
  holder.replaceChildren(...[...groups].map(([prefix, keys]) => el("fieldset", {}, el("legend", { text: `${prefix} (${keys.length})` }),
    ...keys.map((key) => {
      const box = el("input", { type: "checkbox", value: key });
      box.checked = chosen.has(key);
      box.addEventListener("change", () => {
        const now = new Set(state.prefs.metrics || []);
        if (box.checked) now.add(key); else now.delete(key);
        state.prefs.metrics = now.size ? state.metricKeys.filter((k) => now.has(k)) : null;
        savePrefs();
        updateMetricCount();
        serially(loadCurves);
      });
      return el("label", { className: "metric" }, box, key);
    }))));
  if (!groups.size) holder.append(el("p", { className: "hint", text: state.metricKeys.length ? "no metric matches" : "select a run first" }));
}

function updateMetricCount() {
  const chosen = state.prefs.metrics;
  document.getElementById("metric-count").textContent = chosen ? `(${chosen.length} chosen of ${state.metricKeys.length})`
    : `(the default six; ${state.metricKeys.length} logged)`;
}

async function loadMetricKeys() {
  const runIds = orderedSelected();
  state.metricKeys = runIds.length ? await api("metric-keys", { run: runIds }) : [];
  updateMetricCount();
  renderMetricPicker();
}

// ------------------------------------------------------------------ stage timeline (per-stage seconds, stacked)
function stackedBars(lower, slot = 0, slots = 1) {
  // a uPlot path: each point's bar from `lower[i]` up to the series' value (the running total of the stages below),
  // in the slot-th of `slots` side-by-side places of the step (two streams: the trainer's, then the rollout's)
  return (u, seriesIdx, idx0, idx1) => {
    const xs = u.data[0], top = u.data[seriesIdx];
    const gap = xs.length > 1 ? Math.abs(u.valToPos(xs[1], "x", true) - u.valToPos(xs[0], "x", true)) : u.bbox.width / 3;
    const full = Math.max(slots, Math.min(gap * 0.8, 60 * slots * devicePixelRatio));
    const width = full / slots;
    const path = new Path2D();
    for (let i = idx0; i <= idx1; i++) {
      if (top[i] === null || top[i] === undefined || lower[i] === null) continue;
      const x = u.valToPos(xs[i], "x", true) - full / 2 + width * slot;
      const bottom = u.valToPos(lower[i], "y", true), y = u.valToPos(top[i], "y", true);
      path.rect(x, y, width, bottom - y);
    }
    return { stroke: path, fill: path };
  };
}

function timelineOptions(timeline) {
  // the trainer's stream: bands bottom-up in run order, then the controller's overhead, then the step's wall time as
  // a line; with a rollout of its own, its stream beside (its workers' seconds on the step's samples); the legend
  // shows each band's own seconds (the drawn values are running totals)
  const steps = timeline.steps;
  const spacing = steps.length > 1 ? steps[1] - steps[0] : 1;
  const slots = timeline.rollout ? 2 : 1;
  const bands = [...timeline.stages.map((s) => ({ label: `${s.stage} (s)`, values: s.values })),
    { label: "controller overhead (s)", values: timeline.overhead.map((v) => v ?? 0) }];
  const zeros = steps.map(() => 0);
  let below = zeros;
  const series = [], data = [steps];
  const own = (values) => (u, v, si, idx) => (idx === null || values[idx] == null ? "--" : formatNumber(values[idx]));
  bands.forEach((band, i) => {
    const top = band.values.map((v, j) => below[j] + v);
    const colour = i === bands.length - 1 ? "#bbbbbb" : STAGE_COLOURS[i % STAGE_COLOURS.length];
    series.push({ label: band.label, stroke: colour, fill: colour + "dd", width: 0, paths: stackedBars(below, 0, slots),
                  points: { show: false }, value: own(band.values) });
    data.push(top);
    below = top;
  });
  if (timeline.rollout) {
    series.push({ label: "rollout worker generating (s)", stroke: ROLLOUT_COLOUR, fill: ROLLOUT_COLOUR + "dd", width: 0,
                  paths: stackedBars(zeros, 1, 2), points: { show: false }, value: own(timeline.rollout) });
    data.push(timeline.rollout);
  }
  series.push({ label: "time per step (s)", stroke: "#222", width: 1.5, spanGaps: true,
                value: (u, v) => (v === null || v === undefined ? "--" : formatNumber(v)) });
  data.push(timeline.total);
  const options = {
    kind: "timeline", height: 240,
    scales: { x: { time: false, range: (u, min, max) => [min - spacing / 2, max + spacing / 2] },
              y: { range: (u, min, max) => [0, (max || 1) * 1.05] } },
    series: [{ label: "step" }, ...series],
    axes: [{ label: "step", incrs: STEP_TICKS, values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? v : "")) },
           { label: "seconds" }],
  };
  return { options, data };
}

function drawTimelines() {
  const container = document.getElementById("timeline");
  const keep = new Set();
  container.querySelectorAll(".placeholder").forEach((node) => node.remove());
  if (!state.timelineData.length) placeholder(container, "none", "no run selected", "Tick a run to see where its steps spend their time.");
  for (const timeline of state.timelineData) {
    const title = `${runLabel(timeline.run_id)}: seconds per stage`;
    if (!timeline.steps.length) {
      placeholder(container, timeline.run_id, title, "no step finished yet");
      continue;
    }
    const { options, data } = timelineOptions(timeline);
    keep.add(timeline.run_id);
    upsertChart(state.timelines, container, timeline.run_id, title, () => options, data);
  }
  dropCharts(state.timelines, keep);
}

async function loadTimelines() {
  const runIds = orderedSelected().slice(0, 4);  // up to four runs side by side
  state.timelineData = await Promise.all(runIds.map((run) => api("timeline", { run })));
  drawTimelines();
}

// ------------------------------------------------------------------ config differences
async function loadConfigDiff() {
  const table = document.getElementById("config-diff");
  const runIds = orderedSelected();
  table.tHead.replaceChildren();
  table.tBodies[0].replaceChildren();
  if (runIds.length < 2) return;
  const diff = await api("config-diff", { run: runIds });
  table.tHead.append(el("tr", {}, el("th", { text: "key" }), ...runIds.map((r) => el("th", { text: runLabel(r) }))));
  const keys = Object.keys(diff.differing);
  if (!keys.length) table.tBodies[0].append(el("tr", {}, el("td", { text: "the configs are identical" })));
  for (const key of keys) {
    table.tBodies[0].append(el("tr", {}, el("td", { text: key }),
      ...runIds.map((r) => el("td", { text: diff.differing[key][r] ?? "(not set)" }))));
  }
}

// ------------------------------------------------------------------ rollout browser
const SCALES = {
  // positive / negative colour of each colouring; 0 is left uncoloured, the strength is |value| / the largest on the page
  advantage: { key: "token_advantages", positive: [44, 160, 44], negative: [214, 39, 40],
               text: "advantage: green above 0 (reinforced), red below (discouraged), uncoloured at 0" },
  kl: { key: "token_kl", positive: [230, 120, 0], negative: [31, 119, 180],
        text: "KL estimate log π_old − log π_ref: orange where the policy puts more mass than the reference, blue less" },
};

function tokenColour(value, scale, colouring) {
  const strength = scale > 0 ? Math.min(1, Math.abs(value) / scale) : 0;
  const [r, g, b] = value >= 0 ? colouring.positive : colouring.negative;
  return `rgba(${r}, ${g}, ${b}, ${(0.75 * strength).toFixed(2)})`;
}

function renderLegend(colouring, scale) {
  const [pr, pg, pb] = colouring.positive, [nr, ng, nb] = colouring.negative;
  const bar = el("span", { className: "gradient" });
  bar.style.background = `linear-gradient(to right, rgba(${nr},${ng},${nb},0.75), rgba(${nr},${ng},${nb},0) 50%, rgba(${pr},${pg},${pb},0) 50%, rgba(${pr},${pg},${pb},0.75))`;
  document.getElementById("colour-legend").replaceChildren(
    el("span", { text: formatNumber(-scale, 3) }), bar, el("span", { text: `+${formatNumber(scale, 3)}` }),
    el("span", { className: "hint", text: colouring.text }));
}

function responseNode(sample, colourBy, colouring, scale) {
  const response = el("div", { className: "response" });
  const tokens = sample.response_tokens;
  const values = sample[colouring.key];
  if (!tokens || !values) {
    response.textContent = sample.response;  // no per-token values logged (or none for this colouring)
    return response;
  }
  const fromPolicy = sample.token_from_policy;
  tokens.forEach((token, i) => {
    if (fromPolicy && !fromPolicy[i]) {  // a tool's answer or template glue: not trained, shown grey
      response.append(el("span", { className: "token observation", text: token, title: "tool output (not trained)" }));
      return;
    }
    const span = el("span", { className: "token", text: token, title: `${colourBy} ${formatNumber(values[i], 4)}` });
    span.style.backgroundColor = tokenColour(values[i], scale, colouring);
    response.append(span);
  });
  return response;
}

function responseLength(sample) {
  return sample.response_length ?? (sample.response_tokens || []).length;
}

function sampleMeta(sample) {
  const parts = [`score ${formatNumber(sample.score)}`, `advantage ${formatNumber(sample.advantage)}`, `${responseLength(sample)} tokens`];
  if (sample.ground_truth !== undefined && sample.ground_truth !== null) parts.push(`ground truth ${sample.ground_truth}`);
  return parts.join(" · ");
}

// a vision-language run's images beside the response: only the PNG data URLs the run logs (never another URL)
function thumbnails(sample) {
  const safe = (sample.images || []).filter((src) => typeof src === "string" && src.startsWith("data:image/png;base64,"));
  return safe.length ? [el("div", { className: "thumbs" }, ...safe.map((src) => el("img", { src, alt: "prompt image" })))] : [];
}

function sampleCard(sample, colourBy, colouring, scale, grouped) {
  const calls = (sample.tool_calls || []).map((call) => el("li", {
    className: call.error ? "call failed" : "call",
    text: `${call.name ?? "?"}(${JSON.stringify(call.arguments ?? {})}) → ${call.answer}`
      + (call.error ? ` [${call.error}]` : ` (${formatNumber(call.latency_s, 3)} s)`),
  }));
  return el("div", { className: "sample" }, el("div", { className: "meta", text: sampleMeta(sample) }),
    ...(grouped ? [] : [el("div", { className: "prompt", text: sample.prompt })]), ...thumbnails(sample),
    responseNode(sample, colourBy, colouring, scale), ...(calls.length ? [el("ul", { className: "tool-calls" }, ...calls)] : []));
}

function compactRow(sample) {
  const cells = [sample.uid ?? "", sample.question ?? sample.prompt, sample.response_text ?? sample.response,
                 String(responseLength(sample)), formatNumber(sample.score), formatNumber(sample.advantage), sample.ground_truth ?? ""];
  return el("tr", { className: "sample compact-row" }, ...cells.map((text, i) => el("td", { className: i >= 3 && i <= 5 ? "num" : "", text, title: text })));
}

function shownSamples() {
  const low = parseFloat(document.getElementById("score-min").value);
  const high = parseFloat(document.getElementById("score-max").value);
  const needle = document.getElementById("search").value.toLowerCase();
  const by = document.getElementById("sample-sort").value;
  const shown = state.samples.filter((s) => (isNaN(low) || s.score >= low) && (isNaN(high) || s.score <= high)
    && (!needle || `${s.prompt}\n${s.response}`.toLowerCase().includes(needle)));
  const key = { score: (s) => s.score, advantage: (s) => s.advantage, length: responseLength }[by];
  return key ? [...shown].sort((a, b) => key(b) - key(a)) : shown;  // highest first
}

function renderSamples() {
  const container = document.getElementById("samples");
  container.replaceChildren();
  const colourBy = document.getElementById("colour-by").value;
  const colouring = SCALES[colourBy];
  const shown = shownSamples();
  const scale = Math.max(0, ...shown.flatMap((s) => (s[colouring.key] || []).map(Math.abs)));
  renderLegend(colouring, scale);
  if (!shown.length) {
    const text = !orderedSelected().length ? "select a run" : state.samples.length ? "no sample matches the filters" : "no samples logged for this run";
    container.append(el("p", { className: "hint", text }));
    return;
  }
  if (document.getElementById("compact").checked) {
    const head = el("tr", {}, ...["group", "question", "response", "tokens", "score", "advantage", "ground truth"].map((t) => el("th", { text: t })));
    container.append(el("table", { className: "compact" }, el("thead", {}, head), el("tbody", {}, ...shown.map(compactRow))));
    return;
  }
  const grouped = document.getElementById("group-by-prompt").checked && shown.every((s) => s.uid !== undefined);
  if (!grouped) {
    container.append(...shown.map((s) => sampleCard(s, colourBy, colouring, scale, false)));
    return;
  }
  const groups = new Map();  // in the order of each group's first (best, when sorted) sample
  for (const sample of shown) {
    if (!groups.has(sample.uid)) groups.set(sample.uid, []);
    groups.get(sample.uid).push(sample);
  }
  for (const [uid, members] of groups) {
    const mean = members.reduce((sum, s) => sum + s.score, 0) / members.length;
    const head = `group ${uid} · ${members.length} response${members.length > 1 ? "s" : ""} · mean score ${formatNumber(mean)}`
      + (members[0].ground_truth != null ? ` · ground truth ${members[0].ground_truth}` : "");
    container.append(el("div", { className: "group", "data-uid": uid }, el("div", { className: "group-head", text: head }),
      el("div", { className: "prompt", text: members[0].prompt }), ...members.map((s) => sampleCard(s, colourBy, colouring, scale, true))));
  }
}

async function loadSampleSteps(runId) {
  const select = document.getElementById("sample-step");
  document.getElementById("samples-run").textContent = runId ? `(${runLabel(runId)})` : "";
  const previous = select.value;
  const steps = runId ? await api("sample-steps", { run: runId }) : [];
  select.replaceChildren(...steps.map((step) => el("option", { value: String(step), text: String(step) })));
  if (steps.map(String).includes(previous)) select.value = previous;
  else if (steps.length) select.value = String(steps[steps.length - 1]);
  await loadSamples(runId);
}

async function loadSamples(runId) {
  const step = document.getElementById("sample-step").value;
  state.samples = runId && step ? await api("samples", { run: runId, step }) : [];
  renderSamples();
}

// ------------------------------------------------------------------ wiring
function serially(work) {
  // one refresh at a time: a click during a refresh waits for it instead of drawing into the same containers
  state.queue = state.queue.then(work).catch((error) => status(error.message, true));
  return state.queue;
}

function selectionVersion() {
  // what the selection's views depend on: a finished run's never changes, so a refresh then reads nothing more
  return orderedSelected().map((id) => `${id}:${runById(id).status}:${runById(id).step}`).join("|");
}

async function drawSelection() {
  const first = orderedSelected()[0];
  await Promise.all([loadCurves(), loadMetricKeys(), loadConfigDiff(), loadTimelines(), loadSampleSteps(first)]);
  state.drawnVersion = selectionVersion();
  document.body.dataset.rendered = [...state.selected].sort().join(",");  // what the page shows now (tests wait on it)
  status(`updated ${new Date().toLocaleTimeString()}`);
}

function refreshSelection() {
  return serially(drawSelection);
}

function refreshAll() {
  return serially(async () => {
    await loadRuns();
    if (selectionVersion() !== state.drawnVersion) await drawSelection();
    else status(`updated ${new Date().toLocaleTimeString()}`);
  });
}

function wireControls() {
  const select = document.getElementById("experiment");
  select.addEventListener("change", () => { state.selected.clear(); state.userSelected = false; state.drawnVersion = null; refreshAll(); });
  for (const th of document.querySelectorAll("#runs th[data-sort]")) {
    th.addEventListener("click", () => {
      const key = th.dataset.sort;
      state.sort = { key, desc: state.sort.key === key ? !state.sort.desc : key !== "name" };
      renderRuns();
    });
  }
  document.getElementById("sample-step").addEventListener("change", () => serially(() => loadSamples(orderedSelected()[0])));
  for (const id of ["score-min", "score-max", "search", "colour-by", "sample-sort", "group-by-prompt", "compact"]) {
    document.getElementById(id).addEventListener("input", renderSamples);
  }
  for (const id of ["smoothing", "x-axis", "log-scale"]) document.getElementById(id).addEventListener("input", drawCurves);
  document.getElementById("metric-search").addEventListener("input", renderMetricPicker);
  document.getElementById("metric-defaults").addEventListener("click", () => {
    state.prefs.metrics = null;
    savePrefs();
    updateMetricCount();
    renderMetricPicker();
    serially(loadCurves);
  });
}

async function start() {
  state.settings = await api("settings");
  const links = document.getElementById("links");
  for (const [name, text] of [["mlflow_url", "MLflow"], ["prefect_url", "Prefect"], ["ray_dashboard_url", "Ray dashboard"]]) {
    if (state.settings[name]) links.append(el("a", { href: state.settings[name], target: "_blank", rel: "noopener", text }));
  }
  const select = document.getElementById("experiment");
  const experiments = await api("experiments");
  select.replaceChildren(...experiments.map((e) => el("option", { value: e.name, text: e.name })));
  if (experiments.some((e) => e.name === state.settings.default_experiment)) select.value = state.settings.default_experiment;
  wireControls();
  await refreshAll();
  setInterval(() => { if (document.getElementById("autorefresh").checked) refreshAll(); }, 5000);
}

start().catch((error) => status(error.message, true));
