// The run inspector page: reads the read-only JSON API of ui/server.py and draws with uPlot.
// Every logged string is put into the page with textContent (never as HTML): a response holding <script> is text.
"use strict";

const state = { settings: null, runs: [], selected: new Set(), charts: [], samples: [], queue: Promise.resolve() };
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];

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

function runLabel(runId) {
  const run = state.runs.find((r) => r.run_id === runId);
  return run ? `${run.name} (${runId.slice(0, 6)})` : runId.slice(0, 8);
}

function colourOf(runId) {
  const index = state.runs.findIndex((r) => r.run_id === runId);
  return COLOURS[(index < 0 ? 0 : index) % COLOURS.length];
}

function formatNumber(value, digits = 3) {
  return value === null || value === undefined ? "" : Number(value).toFixed(digits);
}

// ------------------------------------------------------------------ runs
function mlflowRunUrl(run) {
  return `${state.settings.mlflow_url}/#/experiments/${run.experiment_id}/runs/${run.run_id}`;
}

function renderRuns() {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  for (const run of state.runs) {
    const box = el("input", { type: "checkbox" });
    box.checked = state.selected.has(run.run_id);
    box.addEventListener("change", () => {
      if (box.checked) state.selected.add(run.run_id); else state.selected.delete(run.run_id);
      refreshSelection();
    });
    const links = el("td", {}, el("a", { href: mlflowRunUrl(run), target: "_blank", rel: "noopener", text: "MLflow" }));
    if (run.prefect_flow_run_id) {
      links.append(" ", el("a", { href: `${state.settings.prefect_url}/runs/flow-run/${run.prefect_flow_run_id}`, target: "_blank",
                                 rel: "noopener", text: "Prefect" }));
    }
    const swatch = el("span", { text: "■ " });
    swatch.style.color = colourOf(run.run_id);
    body.append(el("tr", { "data-run-id": run.run_id },
      el("td", {}, box), el("td", {}, swatch, run.name || run.run_id), el("td", { text: run.status }),
      el("td", { text: run.algorithm }), el("td", { text: run.model }), el("td", { className: "num", text: String(run.step) }),
      el("td", { className: "num", text: formatNumber(run.score) }), links));
  }
}

async function loadRuns() {
  const experiment = document.getElementById("experiment").value || state.settings.default_experiment;
  state.runs = await api("runs", { experiment });
  if (state.selected.size === 0 && state.runs.length) state.selected.add(state.runs[0].run_id);
  for (const runId of [...state.selected]) if (!state.runs.some((r) => r.run_id === runId)) state.selected.delete(runId);
  renderRuns();
}

// ------------------------------------------------------------------ curves
function alignSeries(series) {
  // uPlot wants one shared x axis: the union of the series' steps, with nulls where a series has no point
  const steps = [...new Set(series.flatMap((s) => s.steps))].sort((a, b) => a - b);
  const index = new Map(steps.map((step, i) => [step, i]));
  const columns = series.map((s) => {
    const column = new Array(steps.length).fill(null);
    s.steps.forEach((step, i) => { column[index.get(step)] = s.values[i]; });
    return column;
  });
  return [steps, ...columns];
}

function chartWidth(container) {
  return Math.max(320, Math.min(container.clientWidth || 460, 640));
}

function drawChart(container, title, series, options = {}) {
  const box = el("div", { className: "chart", "data-title": title }, el("h3", { text: title }));
  container.append(box);
  if (!series.length) {
    box.append(el("p", { className: "hint", text: "not logged by the selected runs" }));
    return null;
  }
  const chart = new uPlot({
    width: chartWidth(container), height: 220, scales: { x: { time: false } },
    series: [{ label: "step" }, ...series.map((s) => ({ label: s.label, stroke: s.colour, fill: s.fill, width: 1.5,
                                                         spanGaps: true, paths: s.paths }))],
    axes: [{ label: "step" }, {}],
    ...options,
  }, options.data || alignSeries(series), box);
  state.charts.push(chart);
  return chart;
}

async function loadCurves() {
  const container = document.getElementById("curves");
  const runIds = [...state.selected];
  const curves = runIds.length ? await api("curves", { run: runIds, max_points: 1000 }) : {};
  for (const chart of state.charts) chart.destroy();
  state.charts = [];
  container.replaceChildren();
  for (const [name, lines] of Object.entries(curves)) {
    const series = lines.map((line) => ({
      label: runIds.length > 1 || lines.length > 1 ? `${runLabel(line.run_id)} ${line.key}` : line.key,
      colour: colourOf(line.run_id), steps: line.steps, values: line.values,
    }));
    drawChart(container, name, series);
  }
}

// ------------------------------------------------------------------ stage timeline (stacked timing_s/*)
async function loadTimeline(runId) {
  const container = document.getElementById("timeline");
  container.replaceChildren();
  document.getElementById("timeline-run").textContent = runId ? `(${runLabel(runId)})` : "";
  if (!runId) return;
  const timeline = await api("timeline", { run: runId });
  const stages = timeline.stages;
  // stack: the i-th series is the sum of stages 0..i; drawn top-down so each band shows its own stage
  const cumulative = [];
  stages.forEach((stage, i) => {
    cumulative.push(stage.values.map((value, j) => value + (i ? cumulative[i - 1][j] : 0)));
  });
  const bars = uPlot.paths.bars({ size: [0.8, 40] });
  const order = stages.map((_, i) => i).reverse();
  const series = order.map((i) => ({ label: `${stages[i].stage} (s)`, colour: COLOURS[i % COLOURS.length],
                                     fill: COLOURS[i % COLOURS.length] + "cc", paths: bars }));
  drawChart(container, "seconds per stage, stacked", series, { data: [timeline.steps, ...order.map((i) => cumulative[i])] });
}

// ------------------------------------------------------------------ config differences
async function loadConfigDiff() {
  const table = document.getElementById("config-diff");
  const runIds = [...state.selected];
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
function tokenColour(value, scale) {
  // green for positive, red for negative values; the strength is |value| / the largest |value| on the page
  const strength = scale > 0 ? Math.min(1, Math.abs(value) / scale) : 0;
  const alpha = (0.12 + 0.6 * strength).toFixed(2);
  return value >= 0 ? `rgba(44, 160, 44, ${alpha})` : `rgba(214, 39, 40, ${alpha})`;
}

function renderSamples() {
  const container = document.getElementById("samples");
  container.replaceChildren();
  const low = parseFloat(document.getElementById("score-min").value);
  const high = parseFloat(document.getElementById("score-max").value);
  const needle = document.getElementById("search").value.toLowerCase();
  const colourBy = document.getElementById("colour-by").value;
  const valuesKey = colourBy === "kl" ? "token_kl" : "token_advantages";
  const shown = state.samples.filter((s) => (isNaN(low) || s.score >= low) && (isNaN(high) || s.score <= high)
    && (!needle || `${s.prompt}\n${s.response}`.toLowerCase().includes(needle)));
  const scale = Math.max(0, ...shown.flatMap((s) => (s[valuesKey] || []).map(Math.abs)));
  for (const sample of shown) {
    const response = el("div", { className: "response" });
    const tokens = sample.response_tokens;
    const values = sample[valuesKey];
    if (tokens && values) {
      const fromPolicy = sample.token_from_policy;
      tokens.forEach((token, i) => {
        if (fromPolicy && !fromPolicy[i]) {  // a tool's answer or template glue: not trained, shown grey
          response.append(el("span", { className: "token observation", text: token, title: "tool output (not trained)" }));
          return;
        }
        const span = el("span", { className: "token", text: token, title: `${colourBy} ${formatNumber(values[i], 4)}` });
        span.style.backgroundColor = tokenColour(values[i], scale);
        response.append(span);
      });
    } else {
      response.textContent = sample.response;  // no per-token values logged (or none for this colouring)
    }
    const calls = (sample.tool_calls || []).map((call) => el("li", {
      className: call.error ? "call failed" : "call",
      text: `${call.name ?? "?"}(${JSON.stringify(call.arguments ?? {})}) → ${call.answer}`
        + (call.error ? ` [${call.error}]` : ` (${formatNumber(call.latency_s, 3)} s)`),
    }));
    container.append(el("div", { className: "sample" },
      el("div", { className: "meta", text: `score ${formatNumber(sample.score)} · advantage ${formatNumber(sample.advantage)}` }),
      el("div", { className: "prompt", text: sample.prompt }), response,
      ...(calls.length ? [el("ul", { className: "tool-calls" }, ...calls)] : [])));
  }
  if (!shown.length) container.append(el("p", { className: "hint", text: state.samples.length ? "no sample matches the filters" : "no samples logged for this run" }));
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
function firstSelected() {
  return state.runs.find((r) => state.selected.has(r.run_id))?.run_id;
}

function serially(work) {
  // one refresh at a time: a click during a refresh waits for it instead of drawing into the same containers
  state.queue = state.queue.then(work).catch((error) => status(error.message, true));
  return state.queue;
}

async function drawSelection() {
  await Promise.all([loadCurves(), loadConfigDiff(), loadTimeline(firstSelected()), loadSampleSteps(firstSelected())]);
  document.body.dataset.rendered = [...state.selected].sort().join(",");  // what the page shows now (tests wait on it)
  status(`updated ${new Date().toLocaleTimeString()}`);
}

function refreshSelection() {
  return serially(drawSelection);
}

function refreshAll() {
  return serially(async () => { await loadRuns(); await drawSelection(); });
}

async function start() {
  state.settings = await api("settings");
  const links = document.getElementById("links");
  links.append(el("a", { href: state.settings.mlflow_url, target: "_blank", rel: "noopener", text: "MLflow" }),
               el("a", { href: state.settings.prefect_url, target: "_blank", rel: "noopener", text: "Prefect" }),
               el("a", { href: state.settings.ray_dashboard_url, target: "_blank", rel: "noopener", text: "Ray dashboard" }));
  const select = document.getElementById("experiment");
  const experiments = await api("experiments");
  select.replaceChildren(...experiments.map((e) => el("option", { value: e.name, text: e.name })));
  if (experiments.some((e) => e.name === state.settings.default_experiment)) select.value = state.settings.default_experiment;
  select.addEventListener("change", () => { state.selected.clear(); refreshAll(); });
  document.getElementById("sample-step").addEventListener("change", () => loadSamples(firstSelected()).catch((e) => status(e.message, true)));
  for (const id of ["score-min", "score-max", "search", "colour-by"]) document.getElementById(id).addEventListener("input", renderSamples);
  await refreshAll();
  setInterval(() => { if (document.getElementById("autorefresh").checked) refreshAll(); }, 5000);
}

start().catch((error) => status(error.message, true));
