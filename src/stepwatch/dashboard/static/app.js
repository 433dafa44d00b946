// The stepwatch dashboard: find runs, overlay them (one colour per run, one line style per
// key), follow live runs, and see what the monitors did. Everything comes from the JSON API
// beside this file; nothing is written anywhere. The view lives in the URL.
"use strict";

const MAX_POINTS = 2000; // points per series asked of the server (min/max buckets)
const BAND = 600; // more points than this: a median line inside a min/max band
const POLL_MS = 1000; // a live run's new points show within about two polls
const SUMMARY_MS = 5000;
const CLOCK_MS = 10000; // a live run's step -> time map is read again this often
const PAGE_PANELS = 24; // charts drawn at first; "more charts" adds as many again
const PAGE_ROWS = 200; // table rows drawn before "show every run"
const FETCHES = 6; // metric requests in flight at once
const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#0a7b83", "#e16f24", "#bf3989", "#57606a", "#116329"];
const DASHES = [undefined, [7, 4], [2, 3], [10, 3, 2, 3], [4, 6]];
const EVENT_COLORS = { checkpoint: "#1a7f37", stop: "#cf222e", alert: "#bf8700", status: "#8250df" };
const HIDDEN_KINDS = ["checkpoint"]; // event kinds left out of the list and the charts at first
const Y_FONT = "12px system-ui, sans-serif"; // the y axis labels' font, measured for its width
// The run's machine is "machine": "host" is the bridges' config key (lightning, keras, ...).
const COLUMNS = [
  ["id", "id", true], ["name", "name"], ["status", "status"], ["host", "machine"], ["started", "started"],
  ["duration", "duration", true], ["steps", "steps", true], ["last_loss", "last loss", true], ["best_loss", "best loss", true],
];

const state = {
  runs: [],
  selected: new Set(),
  series: new Map(), // "run|key" -> {steps, values, lo, hi, lastStep}
  keys: new Map(), // run -> [key]
  panels: new Map(), // run -> {panels: {key: chart}, order: [chart], groups: {chart: group}}
  events: new Map(), // run -> [event]
  clocks: new Map(), // run -> {steps, time, epoch, read}
  summaries: new Map(), // run -> {time, summary}
  charts: new Map(), // panel -> {plot, sig, div, entries}
  smoothing: 0,
  axis: "step", // step | time | relative | epoch
  yscale: "auto", // auto | log | linear; per-chart overrides in ylog
  ylog: new Map(), // panel -> true (log) | false (linear)
  zoom: null, // [lo, hi] in x-axis units, or null for the whole run
  query: "",
  sort: { col: "id", dir: "desc" },
  cols: null, // chosen config columns, or null: the config keys that differ between runs
  keyFilter: "",
  hiddenKinds: new Set(HIDDEN_KINDS), // event kinds not listed nor marked
  shownPanels: PAGE_PANELS,
  allRows: false,
  busy: false,
};
window.__stepwatch = { firstDraw: null, interactive: null, state };

// -- fetching -------------------------------------------------------------------------------
let inFlight = 0;
const waiting = [];
async function getJSON(url) {
  // Bounded: a page of many keys must not open thousands of requests at once.
  if (inFlight >= FETCHES) await new Promise((go) => waiting.push(go));
  inFlight++;
  try {
    const answer = await fetch(url, { cache: "no-store" });
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error || answer.statusText);
    return body;
  } finally {
    inFlight--;
    if (waiting.length) waiting.shift()();
  }
}

function runById(id) {
  return state.runs.find((r) => r.id === id);
}

// -- formatting -----------------------------------------------------------------------------
function fmtNumber(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(3) : Number(v.toPrecision(5)).toString();
}

function fmtTick(v) {
  if (v === null || v === undefined) return ""; // a log axis leaves some ticks unlabelled
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(1) : Number(v.toPrecision(4)).toString();
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "-";
  const sign = s < 0 ? "-" : "";
  s = Math.round(Math.abs(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return sign + (h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(r).padStart(2, "0")}s` : `${r}s`);
}

function fmtTime(t, seconds) {
  const d = new Date(t * 1000);
  const two = (n) => String(n).padStart(2, "0");
  const day = `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())}`;
  return `${day} ${two(d.getHours())}:${two(d.getMinutes())}${seconds ? ":" + two(d.getSeconds()) : ""}`;
}

function fmtX(x) {
  if (state.axis === "time") return fmtTime(x, true);
  if (state.axis === "relative") return fmtDuration(x);
  if (state.axis === "epoch") return `epoch ${fmtTick(x)}`;
  return `step ${Math.round(x)}`;
}

function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

// -- the view in the URL --------------------------------------------------------------------
function writeURL() {
  const p = new URLSearchParams();
  const ids = [...state.selected].sort((a, b) => a - b);
  if (ids.length) p.set("runs", ids.join(","));
  if (state.query) p.set("q", state.query);
  if (state.sort.col !== "id" || state.sort.dir !== "desc") p.set("sort", `${state.sort.col}:${state.sort.dir}`);
  if (state.cols) p.set("cols", state.cols.join(","));
  if (state.keyFilter) p.set("keys", state.keyFilter);
  if (state.axis !== "step") p.set("x", state.axis);
  if (state.smoothing) p.set("smooth", String(state.smoothing));
  if (state.yscale !== "auto") p.set("y", state.yscale);
  const forced = (on) => [...state.ylog].filter(([, v]) => v === on).map(([k]) => k).sort().join(",");
  if (forced(true)) p.set("log", forced(true));
  if (forced(false)) p.set("lin", forced(false));
  if (state.zoom) p.set("zoom", state.zoom.join(","));
  const hidden = [...state.hiddenKinds].sort().join(",");
  if (hidden !== [...HIDDEN_KINDS].sort().join(",")) p.set("hide", hidden || "none");
  const text = p.toString().replace(/%2C/g, ",").replace(/%2F/g, "/").replace(/%3A/g, ":").replace(/%3D/g, "=");
  history.replaceState(null, "", text ? `?${text}` : location.pathname);
}

function readURL(known) {
  const p = new URLSearchParams(location.search);
  for (const id of (p.get("runs") || "").split(",").filter(Boolean).map(Number)) if (known.has(id)) state.selected.add(id);
  state.query = p.get("q") || "";
  const [col, dir] = (p.get("sort") || "id:desc").split(":");
  state.sort = { col, dir: dir === "asc" ? "asc" : "desc" };
  state.cols = p.has("cols") ? p.get("cols").split(",").filter(Boolean) : null;
  state.keyFilter = p.get("keys") || "";
  state.axis = ["time", "relative", "epoch"].includes(p.get("x")) ? p.get("x") : "step";
  state.smoothing = Math.min(0.99, Math.max(0, Number(p.get("smooth")) || 0));
  state.yscale = ["log", "linear"].includes(p.get("y")) ? p.get("y") : "auto";
  for (const name of (p.get("log") || "").split(",").filter(Boolean)) state.ylog.set(name, true);
  for (const name of (p.get("lin") || "").split(",").filter(Boolean)) state.ylog.set(name, false);
  const zoom = (p.get("zoom") || "").split(",").map(Number);
  state.zoom = zoom.length === 2 && zoom.every(Number.isFinite) && zoom[0] < zoom[1] ? zoom : null;
  if (p.has("hide")) state.hiddenKinds = new Set(p.get("hide").split(",").filter((k) => k && k !== "none"));
  document.getElementById("search").value = state.query;
  document.getElementById("columns").value = state.cols ? state.cols.join(", ") : "";
  document.getElementById("key-filter").value = state.keyFilter;
  document.getElementById("x-axis").value = state.axis;
  document.getElementById("y-scale").value = state.yscale;
  document.getElementById("smoothing").value = state.smoothing;
  document.getElementById("smoothing-value").textContent = state.smoothing;
}

// -- finding runs ---------------------------------------------------------------------------
function flatConfig(run) {
  if (run.flat) return run.flat;
  const out = {};
  const walk = (obj, prefix) => {
    for (const [k, v] of Object.entries(obj || {})) {
      if (!prefix && k === "directions") continue; // the recorder's own bookkeeping
      if (v && typeof v === "object" && !Array.isArray(v)) walk(v, `${prefix}${k}.`);
      else out[prefix + k] = Array.isArray(v) ? JSON.stringify(v) : v;
    }
  };
  walk(run.config, "");
  run.flat = out;
  return out;
}

// The values a search term's field names: "machine" is where the run ran; "host" is the
// bridges' config key (lightning, keras, ...) and, for a run without one, the machine.
function fieldValues(run, name) {
  if (name === "machine") return [run.host, run.user ? `${run.user}@${run.host}` : undefined];
  const config = flatConfig(run)[name];
  if (name === "host") return [config, run.host];
  if (["id", "name", "status", "user", "started", "duration", "steps", "last_loss", "best_loss"].includes(name)) return [run[name]];
  return [config];
}

const TOKEN = /^([A-Za-z_][\w.\/-]*)(:|=|>=|<=|>|<|!=)(.*)$/;
function matches(run, token) {
  const lower = token.toLowerCase();
  const found = TOKEN.exec(token);
  if (found) {
    const [, name, op, want] = found;
    const values = fieldValues(run, name).filter((v) => v !== undefined && v !== null && v !== "");
    if (!values.length) return op === "!=";
    const holds = (have) => {
      if (op === ">" || op === "<" || op === ">=" || op === "<=") {
        const a = Number(have), b = Number(want);
        if (!Number.isFinite(a) || !Number.isFinite(b)) return false;
        return op === ">" ? a > b : op === "<" ? a < b : op === ">=" ? a >= b : a <= b;
      }
      return typeof have === "number" && want.trim() !== "" && Number.isFinite(Number(want))
        ? have === Number(want)
        : name === "status" || op === "=" || op === "!=" ? String(have).toLowerCase() === want.toLowerCase()
          : String(have).toLowerCase().includes(want.toLowerCase());
    };
    return op === "!=" ? !values.some(holds) : values.some(holds);
  }
  const text = [run.name, run.status, run.host, run.user, ...Object.entries(flatConfig(run)).map(([k, v]) => `${k}=${v}`)];
  return text.some((t) => String(t).toLowerCase().includes(lower));
}

function foundRuns() {
  const tokens = state.query.split(/\s+/).filter(Boolean);
  const rows = state.runs.filter((run) => tokens.every((t) => matches(run, t)));
  const { col, dir } = state.sort;
  const key = col.startsWith("config:") ? (r) => flatConfig(r)[col.slice(7)] : (r) => r[col];
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    const missing = (x === undefined || x === null) - (y === undefined || y === null);
    if (missing) return missing; // runs without the value last, either way
    const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true });
    return (dir === "asc" ? order : -order) || b.id - a.id;
  });
  return rows;
}

// The runs on the charts: the selected ones that the search finds (the table's runs).
function drawnRuns() {
  const ids = [...state.selected].sort((a, b) => a - b);
  if (!state.query) return ids;
  const found = new Set(foundRuns().map((r) => r.id));
  return ids.filter((id) => found.has(id));
}

function configColumns() {
  if (state.cols) return state.cols;
  // The keys whose values differ between the runs (what a comparison is about), up to 5.
  const seen = new Map();
  for (const run of state.runs) for (const [k, v] of Object.entries(flatConfig(run))) {
    if (!seen.has(k)) seen.set(k, new Set());
    seen.get(k).add(JSON.stringify(v));
  }
  // Only short values make a column (a list of callbacks does not); any key can be chosen.
  const short = (v) => typeof v === "number" || typeof v === "boolean" || (typeof v === "string" && v.length <= 24);
  const shortKeys = new Set();
  for (const run of state.runs) for (const [k, v] of Object.entries(flatConfig(run))) if (!short(v)) shortKeys.add(k);
  const differing = [...seen].filter(([k, vs]) => vs.size > 1 && !shortKeys.has(k)).map(([k]) => k).sort();
  return differing.slice(0, 5);
}

function keyMetrics(run) {
  const entry = state.summaries.get(run.id);
  if (!entry) return "";
  const parts = [];
  for (const [key, stats] of Object.entries(entry.summary)) {
    if (key.startsWith("eval_") && key !== "eval_loss" && !key.includes("/")) parts.push(`${key.slice(5)} ${fmtNumber(stats.last)}`);
  }
  return parts.slice(0, 3).join(", ");
}

function runColor(id) {
  const ids = [...state.selected].sort((a, b) => a - b);
  const at = ids.indexOf(id);
  return at < 0 ? null : PALETTE[at % PALETTE.length];
}

let shownRows = [];
function renderTable() {
  const cols = configColumns();
  const head = document.querySelector("#runs thead tr");
  const heads = [`<th title="select runs to overlay"><input type="checkbox" id="select-all" aria-label="select all runs shown"></th>`];
  const sortClass = (col) => (state.sort.col === col ? ` class="sorted-${state.sort.dir}"` : "");
  for (const [col, label] of COLUMNS) heads.push(`<th data-sort="${col}"${sortClass(col)}>${label}</th>`);
  for (const k of cols) heads.push(`<th data-sort="config:${escapeHTML(k)}" class="config${state.sort.col === "config:" + k ? " sorted-" + state.sort.dir : ""}">${escapeHTML(k)}</th>`);
  heads.push("<th>key metrics</th>");
  head.innerHTML = heads.join("");
  const found = foundRuns();
  shownRows = state.allRows ? found : found.slice(0, PAGE_ROWS);
  const rows = shownRows.map((run) => {
    const tr = document.createElement("tr");
    tr.dataset.run = run.id;
    const on = state.selected.has(run.id);
    if (on) tr.classList.add("selected");
    // Every field from the store is escaped: a crafted file must not put markup in the page.
    const status = String(run.status);
    const color = runColor(run.id);
    const swatch = color ? `<span class="swatch" style="background:${color}"></span>` : "";
    const cells = [
      `<td><input type="checkbox" aria-label="overlay run ${escapeHTML(run.id)}"${on ? " checked" : ""}></td>`,
      `<td class="num">${escapeHTML(run.id)}</td>`,
      `<td class="name">${swatch}${escapeHTML(run.name)}</td>`,
      `<td><span class="status status-${status.replace(/[^a-z]/g, "")}">${escapeHTML(status)}</span></td>`,
      `<td>${escapeHTML(run.user ? `${run.user}@${run.host}` : run.host || "")}</td>`,
      `<td>${escapeHTML(fmtTime(run.started))}</td>`,
      `<td class="num">${escapeHTML(fmtDuration(run.duration))}</td>`,
      `<td class="num">${escapeHTML(run.steps)}</td>`,
      `<td class="num">${escapeHTML(fmtNumber(run.last_loss))}</td>`,
      `<td class="num">${escapeHTML(fmtNumber(run.best_loss))}</td>`,
      ...cols.map((k) => `<td class="config">${escapeHTML(fmtNumber(flatConfig(run)[k]))}</td>`),
      `<td>${escapeHTML(keyMetrics(run))}</td>`,
    ];
    tr.innerHTML = cells.join("");
    tr.querySelector("input").addEventListener("click", (ev) => {
      ev.stopPropagation();
      toggleRun(run.id, ev.target.checked);
    });
    tr.addEventListener("click", () => selectOnly(run.id));
    return tr;
  });
  document.querySelector("#runs tbody").replaceChildren(...rows);
  const all = document.getElementById("select-all");
  all.checked = shownRows.length > 0 && shownRows.every((r) => state.selected.has(r.id));
  all.addEventListener("change", (ev) => {
    for (const r of shownRows) if (ev.target.checked) state.selected.add(r.id); else state.selected.delete(r.id);
    selectionChanged();
  });
  for (const th of head.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      const col = th.dataset.sort;
      state.sort = { col, dir: state.sort.col === col && state.sort.dir === "desc" ? "asc" : "desc" };
      writeURL();
      renderTable();
    });
  }
  const more = document.getElementById("all-rows");
  more.hidden = found.length <= shownRows.length;
  more.textContent = `show all ${found.length} runs`;
  document.getElementById("runs-shown").textContent =
    found.length === state.runs.length ? "" : `${found.length} of ${state.runs.length} runs match`;
}

function selectionChanged() {
  writeURL();
  renderTable();
  loadSelection().catch(showError);
}

function toggleRun(id, on) {
  if (on) state.selected.add(id);
  else state.selected.delete(id);
  selectionChanged();
}

function selectOnly(id) {
  state.selected = new Set([id]);
  selectionChanged();
}

// -- x axis: step, wall time, time since start or epoch -------------------------------------
// The server's clock holds anchors (step, wall time, fractional epoch) read from the points'
// own columns; a step between anchors is placed linearly, past the last one at the last pace.
function interp(xs, ys, x) {
  const n = xs.length;
  if (!n) return null;
  if (n === 1) return x === xs[0] ? ys[0] : null;
  let lo = 0, hi = n - 1;
  if (x <= xs[0]) hi = 1;
  else if (x >= xs[n - 1]) lo = n - 2;
  else {
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] <= x) lo = mid; else hi = mid;
    }
  }
  const [x0, x1, y0, y1] = [xs[lo], xs[hi], ys[lo], ys[hi]];
  if (y0 === null || y1 === null) return x === x0 ? y0 : x === x1 ? y1 : null;
  return x1 === x0 ? y0 : y0 + ((y1 - y0) * (x - x0)) / (x1 - x0);
}

function axisValues(run) {
  const clock = state.clocks.get(run);
  if (!clock) return null;
  if (state.axis === "epoch") return clock.epoch;
  if (state.axis === "time") return clock.time;
  const info = runById(run);
  const zero = info ? info.started : clock.time[0];
  return clock.time.map((t) => t - zero);
}

function toX(run, steps) {
  if (state.axis === "step") return steps;
  const clock = state.clocks.get(run);
  const ys = axisValues(run);
  if (!clock || !ys) return null;
  const out = new Array(steps.length);
  let last = -Infinity;
  for (let i = 0; i < steps.length; i++) {
    let x = interp(clock.steps, ys, steps[i]);
    if (x !== null && x <= last) x = last + Math.abs(last) * 1e-12 + 1e-9; // strictly rising
    out[i] = x;
    if (x !== null) last = x;
  }
  return out;
}

function stepsOf(run, xs) {
  if (state.axis === "step") return xs;
  const clock = state.clocks.get(run);
  const ys = axisValues(run);
  if (!clock || !ys) return xs;
  const pairs = clock.steps.map((s, i) => [ys[i], s]).filter((p) => p[0] !== null);
  return xs.map((x) => interp(pairs.map((p) => p[0]), pairs.map((p) => p[1]), x));
}

async function loadClock(run, force) {
  const held = state.clocks.get(run);
  if (state.axis === "step" || (held && !force)) return;
  const clock = await getJSON(`api/runs/${run}/clock`);
  clock.read = Date.now();
  state.clocks.set(run, clock);
}

// -- which keys are drawn -------------------------------------------------------------------
function panelOf(run, key) {
  const found = state.panels.get(run);
  return (found && found.panels[key]) || key;
}

function groupOf(panel) {
  for (const found of state.panels.values()) if (found.groups && found.groups[panel]) return found.groups[panel];
  return "";
}

function panelOrder(name) {
  for (const found of state.panels.values()) {
    const at = found.order.indexOf(name);
    if (at >= 0) return at;
  }
  return Number.MAX_SAFE_INTEGER;
}

function keyWanted(key) {
  const f = state.keyFilter.trim();
  if (!f) return true;
  return f.split(/[\s,]+/).filter(Boolean).some((part) => {
    if (/[*?]/.test(part)) {
      const re = new RegExp("^" + part.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".") + "$", "i");
      return re.test(key);
    }
    return key.toLowerCase().includes(part.toLowerCase());
  });
}

// {panel: [{run, key}]} for every selected run's keys that the filter keeps, in chart order;
// the system group's charts are apart and always drawn, the others a page at a time.
function plannedPanels() {
  const byPanel = new Map();
  for (const run of drawnRuns()) {
    for (const key of state.keys.get(run) || []) {
      if (!keyWanted(key)) continue;
      const name = panelOf(run, key);
      if (!byPanel.has(name)) byPanel.set(name, []);
      byPanel.get(name).push({ run, key });
    }
  }
  const names = [...byPanel.keys()].sort((a, b) => panelOrder(a) - panelOrder(b) || a.localeCompare(b));
  const system = names.filter((n) => groupOf(n) === "system");
  const main = names.filter((n) => groupOf(n) !== "system");
  const shown = main.slice(0, state.shownPanels).concat(system);
  return { byPanel, shown, total: main.length, system: system.length };
}

function visibleKeys(run) {
  const plan = plannedPanels();
  const out = [];
  for (const name of plan.shown) for (const e of plan.byPanel.get(name)) if (e.run === run) out.push(e.key);
  return out;
}

// -- fetching series ------------------------------------------------------------------------
function metricsURL(run, key, extra) {
  const params = new URLSearchParams({ max_points: MAX_POINTS, band: BAND, ...extra });
  return `api/runs/${run}/metrics/${encodeURIComponent(key)}?${params}`;
}

function zoomSteps(run) {
  if (!state.zoom) return {};
  const [a, b] = stepsOf(run, state.zoom);
  if (a === null || b === null) return {};
  return { start: Math.floor(a) - 1, end: Math.ceil(b) + 1 };
}

async function fetchSeries(run, key) {
  const data = await getJSON(metricsURL(run, key, zoomSteps(run)));
  const known = state.series.get(`${run}|${key}`);
  // The newest step the page holds: the live poll asks only for what comes after it.
  const last = data.steps.length ? data.steps[data.steps.length - 1] : -1;
  const lastStep = state.zoom && known ? Math.max(known.lastStep, last) : last;
  state.series.set(`${run}|${key}`, { ...data, lastStep });
}

async function loadRun(run) {
  if (!state.keys.has(run)) {
    const [keys, events, panels] = await Promise.all([
      getJSON(`api/runs/${run}/keys`),
      getJSON(`api/runs/${run}/events`),
      getJSON(`api/runs/${run}/panels`),
    ]);
    state.keys.set(run, keys);
    state.panels.set(run, panels);
    state.events.set(run, events);
  }
  await loadClock(run, false);
}

async function loadSelection() {
  const runs = drawnRuns();
  await Promise.all(runs.map(loadRun));
  const jobs = [];
  for (const run of runs) for (const key of visibleKeys(run)) if (!state.series.has(`${run}|${key}`)) jobs.push(fetchSeries(run, key));
  await Promise.all(jobs);
  draw();
}

async function refetchVisible() {
  const jobs = [];
  for (const run of drawnRuns()) for (const key of visibleKeys(run)) jobs.push(fetchSeries(run, key));
  await Promise.all(jobs);
  document.getElementById("zoom-range").textContent = state.zoom ? `${fmtX(state.zoom[0])} – ${fmtX(state.zoom[1])}` : "";
  draw();
}

async function followLive(run) {
  // Only what is new, and only for the charts on the page.
  const [keys, panels, events] = await Promise.all([
    getJSON(`api/runs/${run}/keys`), getJSON(`api/runs/${run}/panels`), getJSON(`api/runs/${run}/events`),
  ]);
  let changed = events.length !== (state.events.get(run) || []).length;
  state.keys.set(run, keys);
  state.panels.set(run, panels);
  state.events.set(run, events);
  const clock = state.clocks.get(run);
  if (state.axis !== "step" && (!clock || Date.now() - clock.read > CLOCK_MS)) {
    await loadClock(run, true);
    changed = true;
  }
  await Promise.all(
    visibleKeys(run).map(async (key) => {
      const held = state.series.get(`${run}|${key}`);
      if (!held) {
        await fetchSeries(run, key);
        changed = true;
        return;
      }
      const fresh = await getJSON(metricsURL(run, key, { after: held.lastStep }));
      if (!fresh.steps.length) return;
      held.lastStep = fresh.steps[fresh.steps.length - 1];
      if (!state.zoom) {
        for (const part of ["steps", "values", "lo", "hi"]) held[part] = held[part].concat(fresh[part]);
      }
      changed = true;
    }),
  );
  return changed;
}

let lastSeen = "";
async function tick() {
  if (state.busy) return;
  state.busy = true;
  try {
    const before = new Map(state.runs.map((r) => [r.id, r]));
    state.runs = await getJSON("api/runs");
    document.getElementById("db-status").textContent = `${state.runs.length} runs`;
    let redraw = false;
    let budget = 8; // summaries read per poll: a store of many runs fills the column over a few
    for (const run of shownRows.length ? shownRows : state.runs) {
      const fresh = state.runs.find((r) => r.id === run.id);
      if (!fresh) continue;
      const old = before.get(run.id);
      const moved = !old || old.steps !== fresh.steps || old.status !== fresh.status;
      const entry = state.summaries.get(run.id);
      if (budget > 0 && (!entry || (moved && Date.now() - entry.time > SUMMARY_MS) || (old && old.status !== fresh.status))) {
        budget--;
        state.summaries.set(run.id, { time: Date.now(), summary: await getJSON(`api/runs/${run.id}/summary`) });
      }
    }
    const drawn = new Set(drawnRuns());
    for (const run of state.runs) {
      const old = before.get(run.id);
      const moved = old && (old.steps !== run.steps || old.status !== run.status);
      if (drawn.has(run.id) && moved && (await followLive(run.id))) redraw = true;
    }
    // Redrawn only when something changed: a row under the mouse stays put.
    const seen = JSON.stringify(state.runs) + [...state.summaries.values()].map((e) => e.time).join();
    if (seen !== lastSeen) renderTable();
    lastSeen = seen;
    if (redraw) draw();
  } catch (err) {
    showError(err);
  } finally {
    state.busy = false;
  }
}

function showError(err) {
  document.getElementById("db-status").textContent = `error: ${err.message}`;
}

// -- drawing --------------------------------------------------------------------------------
function smooth(values, weight) {
  if (!weight) return values;
  const out = new Array(values.length);
  let last = 0, count = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null) { out[i] = null; continue; }
    last = last * weight + (1 - weight) * v;
    count++;
    out[i] = last / (1 - Math.pow(weight, count)); // unbiased at the start, as an EMA
  }
  return out;
}

function withAlpha(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

function hasBand(held) {
  if (!held.lo) return false;
  for (let i = 0; i < held.lo.length; i++) if (held.lo[i] !== held.hi[i]) return true;
  return false;
}

function chartEntries(name, plan) {
  const panelKeys = [...new Set(plan.byPanel.get(name).map((e) => e.key))].sort();
  const many = drawnRuns().length > 1;
  const out = [];
  for (const { run, key } of plan.byPanel.get(name)) {
    let held = state.series.get(`${run}|${key}`);
    if (!held) continue;
    let xs = toX(run, held.steps);
    if (!xs) continue;
    if (xs.includes(null)) {
      // Points the axis cannot place (no epoch recorded, say) are left out, not guessed.
      const keep = xs.map((x, i) => (x === null ? -1 : i)).filter((i) => i >= 0);
      if (!keep.length) continue;
      const pick = (vs) => vs && keep.map((i) => vs[i]);
      held = { ...held, steps: pick(held.steps), values: pick(held.values), lo: pick(held.lo), hi: pick(held.hi) };
      xs = keep.map((i) => xs[i]);
    }
    const info = runById(run);
    const color = runColor(run);
    const evaluating = key.startsWith("eval_");
    out.push({
      run, key, held, xs, color,
      label: many ? `${run}:${info ? info.name : run} ${key}` : key,
      band: hasBand(held),
      dash: DASHES[panelKeys.indexOf(key) % DASHES.length],
      width: key === "step_loss" ? 1.25 : 2,
      points: key === "loss" || evaluating || key.startsWith("train_"),
    });
  }
  return out;
}

function wantsLog(name, entries) {
  if (state.ylog.has(name)) return state.ylog.get(name);
  if (state.yscale !== "auto") return state.yscale === "log";
  // Automatic, by the PNG plots' rule: log when every value is positive and they span three
  // decades or more.
  let lo = Infinity, hi = -Infinity;
  for (const e of entries) {
    for (const part of [e.held.lo || e.held.values, e.held.hi || e.held.values]) {
      for (const v of part) {
        if (v === null) continue;
        if (v <= 0) return false;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
  }
  return hi > 0 && hi / lo >= 1e3;
}

function chartData(entries, log) {
  const positive = (vs) => (log ? vs.map((v) => (v !== null && v > 0 ? v : null)) : vs);
  const tables = entries.map((e) => {
    const table = [e.xs, positive(smooth(e.held.values, state.smoothing))];
    if (e.band) table.push(positive(e.held.lo), positive(e.held.hi));
    return table;
  });
  return tables.length === 1 ? tables[0] : uPlot.join(tables);
}

function seriesOptions(entries) {
  const series = [{ label: state.axis }];
  const bands = [];
  const lines = [];
  for (const e of entries) {
    lines.push(series.length);
    series.push({
      label: e.label, stroke: e.color, width: e.width, dash: e.dash, spanGaps: true,
      points: { show: e.points, size: 4, stroke: e.color, fill: e.color },
    });
    if (e.band) {
      const at = series.length;
      const edge = { stroke: withAlpha(e.color, 0.25), width: 0.5, spanGaps: true, points: { show: false } };
      series.push({ label: `${e.label} min`, ...edge }, { label: `${e.label} max`, ...edge });
      bands.push({ series: [at + 1, at], fill: withAlpha(e.color, 0.14) });
    }
  }
  return { series, bands, lines };
}

function eventsOf(entries) {
  const out = [];
  for (const run of new Set(entries.map((e) => e.run))) {
    for (const ev of state.events.get(run) || []) {
      if (ev.step === null || ev.step === undefined || state.hiddenKinds.has(ev.kind)) continue;
      const x = toX(run, [ev.step]);
      if (x && x[0] !== null) out.push({ ...ev, run, x: x[0] });
    }
  }
  return out;
}

function eventColor(ev) {
  return EVENT_COLORS[ev.kind] || (ev.level === "warning" || ev.level === "error" ? EVENT_COLORS.alert : "#8c959f");
}

function markers(chart) {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          const drawn = [];
          ctx.save();
          for (const ev of chart.events) {
            const x = Math.round(u.valToPos(ev.x, "x", true));
            if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
            drawn.push(`${ev.run}:${ev.step}:${ev.kind}`);
            ctx.strokeStyle = eventColor(ev);
            ctx.lineWidth = 1;
            ctx.setLineDash([2, 3]);
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            if (ev.kind === "alert" || ev.kind === "stop") {
              // A flag at the top: the event's colour, edged in its run's colour.
              const s = 7 * devicePixelRatio;
              ctx.setLineDash([]);
              ctx.fillStyle = eventColor(ev);
              ctx.strokeStyle = runColor(ev.run) || "#57606a";
              ctx.lineWidth = 1.5 * devicePixelRatio;
              ctx.beginPath();
              ctx.moveTo(x - s, u.bbox.top);
              ctx.lineTo(x + s, u.bbox.top);
              ctx.lineTo(x, u.bbox.top + 1.6 * s);
              ctx.closePath();
              ctx.fill();
              ctx.stroke();
            }
          }
          ctx.restore();
          chart.div.dataset.markers = drawn.join("|");
        },
      ],
    },
  };
}

function noteDrawn(chart, u) {
  let points = 0;
  for (const i of chart.lines) for (const v of u.data[i]) if (v !== null && v !== undefined) points++;
  const xs = u.data[0];
  const div = chart.div;
  div.dataset.points = points;
  div.dataset.lastStep = xs.length ? xs[xs.length - 1] : -1;
  div.dataset.series = chart.lines.map((i) => u.series[i].label).join("|");
  div.dataset.colors = chart.lines.map((i) => u.series[i].stroke()).join("|");
  div.dataset.bands = chart.entries.filter((e) => e.band).length;
  div.dataset.log = chart.log ? "1" : "0";
  if (window.__stepwatch.firstDraw === null && points > 0) window.__stepwatch.firstDraw = performance.now();
}

function nearest(xs, x) {
  let lo = 0, hi = xs.length - 1;
  if (hi < 0) return -1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] === null || xs[mid] <= x) lo = mid; else hi = mid;
  }
  return Math.abs(xs[hi] - x) < Math.abs(xs[lo] - x) ? hi : lo;
}

function showTip(chart, u) {
  const tip = document.getElementById("tip");
  const left = u.cursor.left;
  if (chart !== hovered || left === undefined || left < 0) { if (chart === hovered) tip.hidden = true; return; }
  const x = u.posToVal(left, "x");
  const rows = [];
  for (const e of chart.entries) {
    const i = nearest(e.xs, x);
    if (i < 0) continue;
    const v = smooth(e.held.values, state.smoothing)[i];
    const info = runById(e.run);
    const where = state.axis === "step" ? (e.held.steps[i] !== Math.round(x) ? ` (step ${e.held.steps[i]})` : "") : ` (step ${e.held.steps[i]})`;
    rows.push(`<tr><td><span class="swatch" style="background:${e.color}"></span>${escapeHTML(info ? info.name : e.run)}</td>` +
      `<td class="muted">${escapeHTML(e.key)}</td><td class="num">${escapeHTML(fmtNumber(v))}${escapeHTML(where)}</td></tr>`);
  }
  const near = chart.events.filter((ev) => Math.abs(u.valToPos(ev.x, "x") - left) <= 6);
  const evs = near.map((ev) => {
    const actions = (ev.data && ev.data.actions) || [];
    const did = actions.length ? ` → ${actions.join("; ")}` : "";
    return `<div class="event">run ${escapeHTML(ev.run)} step ${escapeHTML(ev.step)} [${escapeHTML(ev.kind)}] ${escapeHTML(ev.message)}${escapeHTML(did)}</div>`;
  });
  tip.innerHTML = `<b>${escapeHTML(fmtX(x))}</b><table>${rows.join("")}</table>${evs.join("")}`;
  tip.hidden = false;
  const box = u.over.getBoundingClientRect();
  const px = box.left + left + 16, py = box.top + (u.cursor.top || 0) + 12;
  tip.style.left = `${Math.min(px, window.innerWidth - tip.offsetWidth - 8)}px`;
  tip.style.top = `${Math.min(py, window.innerHeight - tip.offsetHeight - 8)}px`;
}

let hovered = null;

function chartWidth(div) {
  return Math.max(300, div.clientWidth - 12);
}

function xAxis() {
  const axis = { label: { step: "step", time: "wall time", relative: "time since start", epoch: "epoch" }[state.axis] };
  if (state.axis === "relative") axis.values = (u, splits) => splits.map(fmtDuration);
  else if (state.axis !== "time") axis.values = (u, splits) => splits.map(fmtTick);
  return axis;
}

// The y axis as wide as its widest label (uPlot's fixed 50 px clips "0.00175"): uPlot asks
// again after each labelling until the size settles.
function yAxisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;
  let widest = 0;
  if (values) {
    u.ctx.font = Y_FONT;
    for (const v of values) if (v) widest = Math.max(widest, u.ctx.measureText(v).width);
  }
  return Math.ceil(Math.max(40, widest + axis.ticks.size + axis.gap + 6));
}

function makeChart(chart) {
  const { series, bands, lines } = seriesOptions(chart.entries);
  chart.lines = lines;
  const opts = {
    width: chartWidth(chart.div),
    height: 260,
    scales: { x: { time: state.axis === "time" }, y: chart.log ? { distr: 3 } : {} },
    axes: [xAxis(), { size: yAxisSize, font: Y_FONT, values: (u, splits) => splits.map(fmtTick) }],
    cursor: { drag: { x: true, y: false, setScale: false }, sync: { key: "x" }, points: { show: false } },
    legend: { show: false },
    series,
    bands,
    plugins: [markers(chart)],
    hooks: {
      draw: [(u) => noteDrawn(chart, u)],
      setCursor: [(u) => showTip(chart, u)],
      setSelect: [
        (u) => {
          if (u.select.width < 4) return;
          const lo = u.posToVal(u.select.left, "x");
          const hi = u.posToVal(u.select.left + u.select.width, "x");
          u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
          // Rounded as the URL keeps it, so that a link gives this very view.
          state.zoom = state.axis === "step" ? [Math.floor(lo), Math.ceil(hi)] : [lo, hi].map((v) => Number(v.toPrecision(12)));
          writeURL();
          refetchVisible().catch(showError);
        },
      ],
    },
  };
  const plot = new uPlot(opts, chartData(chart.entries, chart.log), chart.div.querySelector(".plot"));
  plot.over.addEventListener("mouseenter", () => { hovered = chart; });
  plot.over.addEventListener("mouseleave", () => { hovered = null; document.getElementById("tip").hidden = true; });
  plot.over.addEventListener("dblclick", () => {
    if (!state.zoom) return;
    state.zoom = null;
    writeURL();
    refetchVisible().catch(showError);
  });
  return plot;
}

function keyLegend(entries) {
  const keys = new Map();
  for (const e of entries) if (!keys.has(e.key)) keys.set(e.key, e.dash);
  if (keys.size < 2) return "";
  return [...keys].map(([key, dash]) =>
    `<span><svg width="26" height="8"><line x1="0" y1="4" x2="26" y2="4" stroke="#57606a" stroke-width="2"` +
    `${dash ? ` stroke-dasharray="${dash.join(" ")}"` : ""}/></svg>${escapeHTML(key)}</span>`).join("");
}

function renderLegend() {
  const ids = drawnRuns();
  document.getElementById("legend").innerHTML = ids.map((id) => {
    const run = runById(id);
    return `<span class="run" data-run="${escapeHTML(id)}"><span class="swatch" style="background:${runColor(id)}"></span>` +
      `${escapeHTML(id)} ${escapeHTML(run ? run.name : "")} <span class="muted">${escapeHTML(run ? run.status : "")}</span></span>`;
  }).join("");
}

function draw() {
  const plan = plannedPanels();
  const wanted = new Map();
  for (const name of plan.shown) {
    const entries = chartEntries(name, plan);
    if (entries.length) wanted.set(name, entries);
  }
  for (const [name, chart] of state.charts) {
    if (!wanted.has(name)) {
      chart.plot.destroy();
      chart.div.remove();
      state.charts.delete(name);
    }
  }
  for (const [name, entries] of wanted) {
    const log = wantsLog(name, entries);
    const sig = [state.axis, log, ...entries.map((e) => `${e.label}:${e.color}:${e.band}`)].join("|");
    let chart = state.charts.get(name);
    if (chart && chart.sig !== sig) {
      chart.plot.destroy();
      chart.div.remove();
      chart = undefined;
    }
    if (!chart) {
      const div = document.createElement("div");
      div.className = "chart";
      div.dataset.panel = name;
      const system = groupOf(name) === "system";
      const title = system ? name.replace(/^system\//, "") : name;
      div.innerHTML = `<h3><span class="title">${escapeHTML(title)}</span><span class="keys">${keyLegend(entries)}</span>` +
        `<button type="button" class="yscale" title="switch this chart's y scale">${log ? "log y" : "linear y"}</button></h3><div class="plot"></div>`;
      div.querySelector(".yscale").addEventListener("click", () => {
        state.ylog.set(name, !log);
        writeURL();
        draw();
      });
      chart = { div, sig, entries, log, system, events: eventsOf(entries) };
      document.getElementById(system ? "system-charts" : "charts").appendChild(div);
      chart.plot = makeChart(chart);
      state.charts.set(name, chart);
    } else {
      chart.entries = entries;
      chart.events = eventsOf(entries);
      chart.plot.setData(chartData(entries, log), !state.zoom);
    }
    if (state.zoom) chart.plot.setScale("x", { min: state.zoom[0], max: state.zoom[1] });
  }
  // Keep the charts in their order.
  for (const name of wanted.keys()) {
    const chart = state.charts.get(name);
    document.getElementById(chart.system ? "system-charts" : "charts").appendChild(chart.div);
  }
  document.getElementById("system-box").hidden = plan.system === 0;
  const note = document.getElementById("charts-note");
  note.hidden = !(state.selected.size && !drawnRuns().length);
  note.textContent = `the search finds none of the ${state.selected.size} selected runs: clear it, or tick a run it finds`;
  const more = document.getElementById("more-panels");
  const left = plan.total - Math.min(plan.total, state.shownPanels);
  more.hidden = left <= 0;
  more.textContent = `${Math.min(left, PAGE_PANELS)} more charts (${left} not drawn)`;
  const keys = new Set();
  for (const run of drawnRuns()) for (const k of state.keys.get(run) || []) keys.add(k);
  document.getElementById("key-count").textContent = keys.size > 12
    ? `${keys.size} keys, ${plan.total + plan.system} charts${plan.total > state.shownPanels ? `, first ${state.shownPanels} drawn` : ""}`
    : "";
  renderLegend();
  renderEvents();
  if (window.__stepwatch.interactive === null && state.charts.size) window.__stepwatch.interactive = performance.now();
}

function eventLine(run, ev) {
  const li = document.createElement("li");
  li.className = `kind-${String(ev.kind).replace(/[^a-z]/g, "")}`;
  const info = runById(run);
  const where = ev.step === null ? "" : ` step ${ev.step}`;
  const what = ev.kind === "alert" && ev.data && ev.data.kind ? ` ${ev.data.kind}` : "";
  li.innerHTML = `<span class="swatch" style="background:${runColor(run)}"></span>`;
  li.append(`run ${run} ${info ? info.name : ""}${where} [${ev.kind}${what}] ${ev.message}`);
  const actions = (ev.data && Array.isArray(ev.data.actions)) ? ev.data.actions : [];
  if (actions.length) {
    const ul = document.createElement("ul");
    ul.className = "actions";
    for (const a of actions) {
      const item = document.createElement("li");
      item.textContent = `→ ${a}`;
      ul.appendChild(item);
    }
    li.appendChild(ul);
  }
  return li;
}

// Hidden events between two shown ones: one quiet line ("8 checkpoints, steps 10–80").
function foldedLine(run, folded) {
  const li = document.createElement("li");
  li.className = "folded";
  const counts = new Map();
  for (const ev of folded) counts.set(ev.kind, (counts.get(ev.kind) || 0) + 1);
  const steps = folded.map((ev) => ev.step).filter((s) => s !== null && s !== undefined);
  const span = !steps.length ? "" : steps.length === 1 ? `, step ${steps[0]}` : `, steps ${steps[0]}–${steps[steps.length - 1]}`;
  const plural = (k, n) => (n === 1 ? k : k.endsWith("s") ? `${k}es` : `${k}s`);
  li.textContent = `run ${run}: ${[...counts].map(([k, n]) => `${n} ${plural(k, n)}`).join(", ")}${span}`;
  return li;
}

function renderEventKinds(counts) {
  const box = document.getElementById("event-kinds");
  const boxes = [...counts].sort(([a], [b]) => a.localeCompare(b)).map(([kind, n]) => {
    const label = document.createElement("label");
    label.className = `kind-${String(kind).replace(/[^a-z]/g, "")}`;
    const input = document.createElement("input");
    input.type = "checkbox";
    input.value = kind;
    input.checked = !state.hiddenKinds.has(kind);
    input.addEventListener("change", () => {
      if (input.checked) state.hiddenKinds.delete(kind); else state.hiddenKinds.add(kind);
      writeURL();
      draw();
    });
    label.append(input, `${kind} (${n})`);
    return label;
  });
  box.replaceChildren(...boxes);
}

function renderEvents() {
  const items = [];
  const counts = new Map();
  for (const run of drawnRuns()) {
    const all = state.events.get(run) || [];
    for (const ev of all) counts.set(ev.kind, (counts.get(ev.kind) || 0) + 1);
    // Every alert and stop (what the monitors did), and the last 20 of the rest that are shown;
    // the hidden kinds fold into one line between the shown events.
    const important = (ev) => ev.kind === "alert" || ev.kind === "stop";
    const rest = all.filter((ev) => !important(ev) && !state.hiddenKinds.has(ev.kind)).slice(-20);
    let folded = [];
    for (const ev of all) {
      if (!state.hiddenKinds.has(ev.kind) && (important(ev) || rest.includes(ev))) {
        if (folded.length) items.push(foldedLine(run, folded));
        folded = [];
        items.push(eventLine(run, ev));
      } else if (state.hiddenKinds.has(ev.kind)) {
        folded.push(ev);
      }
    }
    if (folded.length) items.push(foldedLine(run, folded));
  }
  renderEventKinds(counts);
  document.getElementById("events").replaceChildren(...items);
}

// -- start ----------------------------------------------------------------------------------
function debounce(fn, ms) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

function setupControls() {
  const slider = document.getElementById("smoothing");
  slider.addEventListener("input", () => {
    state.smoothing = Number(slider.value);
    document.getElementById("smoothing-value").textContent = slider.value;
    writeURL();
    draw();
  });
  document.getElementById("y-scale").addEventListener("change", (ev) => {
    state.yscale = ev.target.value;
    state.ylog.clear();
    writeURL();
    draw();
  });
  document.getElementById("x-axis").addEventListener("change", (ev) => {
    state.axis = ev.target.value;
    state.zoom = null;
    document.getElementById("zoom-range").textContent = "";
    writeURL();
    Promise.all([...state.selected].map((r) => loadClock(r, false))).then(refetchVisible).catch(showError);
  });
  document.getElementById("search").addEventListener("input", debounce((ev) => {
    state.query = ev.target.value.trim();
    writeURL();
    renderTable();
    loadSelection().catch(showError); // the charts show the selected runs the search finds
  }, 150));
  document.getElementById("columns").addEventListener("change", (ev) => {
    const cols = ev.target.value.split(",").map((s) => s.trim()).filter(Boolean);
    state.cols = cols.length ? cols : null;
    writeURL();
    renderTable();
  });
  document.getElementById("key-filter").addEventListener("input", debounce((ev) => {
    state.keyFilter = ev.target.value.trim();
    state.shownPanels = PAGE_PANELS;
    writeURL();
    loadSelection().catch(showError);
  }, 200));
  document.getElementById("more-panels").addEventListener("click", () => {
    state.shownPanels += PAGE_PANELS;
    loadSelection().catch(showError);
  });
  document.getElementById("all-rows").addEventListener("click", () => {
    state.allRows = true;
    renderTable();
  });
  window.addEventListener("resize", debounce(() => {
    for (const chart of state.charts.values()) chart.plot.setSize({ width: chartWidth(chart.div), height: 260 });
  }, 100));
}

async function start() {
  setupControls();
  state.runs = await getJSON("api/runs");
  readURL(new Set(state.runs.map((r) => r.id)));
  if (!state.selected.size && state.runs.length) state.selected.add(state.runs[state.runs.length - 1].id);
  renderTable();
  document.getElementById("db-status").textContent = `${state.runs.length} runs`;
  await Promise.all([...state.selected].map(loadRun));
  if (state.zoom) await refetchVisible();
  else await loadSelection();
  setInterval(tick, POLL_MS);
}

start().catch(showError);
