// The stepwatch dashboard: the runs table, one chart per value (runs overlaid), live updates.
// Everything comes from the JSON API beside this file; nothing is written anywhere.
"use strict";

const MAX_POINTS = 2000; // points per series asked of the server (min/max buckets)
const POLL_MS = 1000; // a live run's new points show within about two polls
const SUMMARY_MS = 5000;
const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#0a7b83", "#d1242f", "#57606a"];
const EVENT_COLORS = { checkpoint: "#1a7f37", stop: "#cf222e", alert: "#bf8700", status: "#8250df" };

const state = {
  runs: [],
  selected: new Set(),
  series: new Map(), // "run|key" -> {steps, values, lastStep}
  keys: new Map(), // run -> [key]
  panels: new Map(), // run -> {panels: {key: chart}, order: [chart]}
  events: new Map(), // run -> [event]
  summaries: new Map(), // run -> {time, steps, summary}
  charts: new Map(), // panel -> {plot, labels, div}
  smoothing: 0,
  logY: false,
  zoom: null, // [start, end] steps, or null for the whole run
  busy: false,
};
window.__stepwatch = { firstDraw: null, state };

async function getJSON(url) {
  const answer = await fetch(url, { cache: "no-store" });
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

function runById(id) {
  return state.runs.find((r) => r.id === id);
}

function fmtNumber(v) {
  if (v === null || v === undefined) return "-";
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(3) : Number(v.toPrecision(5)).toString();
}

// Axis ticks: short enough for the axis' 60 px (5e-4, not 5.000e-4).
function fmtTick(v) {
  if (v === null || v === undefined) return ""; // a log axis leaves some ticks unlabelled
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(1) : Number(v.toPrecision(4)).toString();
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(r).padStart(2, "0")}s` : `${r}s`;
}

function fmtTime(t) {
  const d = new Date(t * 1000);
  const two = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}`;
}

// -- which chart a value goes in: the server says (one rule for the page and the PNG plots) --
function panelOf(run, key) {
  const found = state.panels.get(run);
  return (found && found.panels[key]) || key;
}

function panelOrder(name) {
  for (const found of state.panels.values()) {
    const at = found.order.indexOf(name);
    if (at >= 0) return at;
  }
  return Number.MAX_SAFE_INTEGER;
}

// -- the runs table -------------------------------------------------------------------------
function keyMetrics(run) {
  const entry = state.summaries.get(run.id);
  if (!entry) return "";
  const parts = [];
  for (const [key, stats] of Object.entries(entry.summary)) {
    if (key.startsWith("eval_") && key !== "eval_loss" && !key.includes("/")) {
      parts.push(`${key.slice(5)} ${fmtNumber(stats.last)}`);
    }
  }
  return parts.slice(0, 3).join(", ");
}

function renderTable() {
  const body = document.querySelector("#runs tbody");
  const rows = [];
  for (const run of [...state.runs].reverse()) {
    const tr = document.createElement("tr");
    tr.dataset.run = run.id;
    if (state.selected.has(run.id)) tr.classList.add("selected");
    // Every field from the store is escaped: a crafted file must not put markup in the page.
    const status = String(run.status);
    const statusClass = status.replace(/[^a-z]/g, "");
    const cells = [
      `<input type="checkbox" aria-label="overlay run ${escapeHTML(run.id)}"${state.selected.has(run.id) ? " checked" : ""}>`,
      escapeHTML(run.id),
      escapeHTML(run.name),
      `<span class="status status-${statusClass}">${escapeHTML(status)}</span>`,
      escapeHTML(fmtTime(run.started)),
      escapeHTML(fmtDuration(run.duration)),
      escapeHTML(run.steps),
      escapeHTML(fmtNumber(run.last_loss)),
      escapeHTML(fmtNumber(run.best_loss)),
      escapeHTML(keyMetrics(run)),
    ];
    tr.innerHTML = cells.map((c, i) => `<td${[1, 6, 7, 8].includes(i) ? ' class="num"' : ""}>${c}</td>`).join("");
    tr.querySelector("input").addEventListener("click", (ev) => {
      ev.stopPropagation();
      toggleRun(run.id, ev.target.checked);
    });
    tr.addEventListener("click", () => selectOnly(run.id));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  document.getElementById("select-all").checked =
    state.runs.length > 0 && state.runs.every((r) => state.selected.has(r.id));
}

function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function selectionChanged() {
  const ids = [...state.selected].sort((a, b) => a - b);
  history.replaceState(null, "", ids.length ? `?runs=${ids.join(",")}` : location.pathname);
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

// -- fetching series ------------------------------------------------------------------------
function metricsURL(run, key, extra) {
  const params = new URLSearchParams({ max_points: MAX_POINTS, ...extra });
  return `api/runs/${run}/metrics/${encodeURIComponent(key)}?${params}`;
}

async function fetchSeries(run, key) {
  const extra = state.zoom ? { start: state.zoom[0], end: state.zoom[1] } : {};
  const data = await getJSON(metricsURL(run, key, extra));
  const known = state.series.get(`${run}|${key}`);
  // The newest step the page holds: the live poll asks only for what comes after it.
  const lastStep = state.zoom && known ? known.lastStep : data.steps.length ? data.steps[data.steps.length - 1] : -1;
  state.series.set(`${run}|${key}`, { steps: data.steps, values: data.values, lastStep });
}

async function loadRun(run) {
  const [keys, events, panels] = await Promise.all([
    getJSON(`api/runs/${run}/keys`),
    getJSON(`api/runs/${run}/events`),
    getJSON(`api/runs/${run}/panels`),
  ]);
  state.keys.set(run, keys);
  state.panels.set(run, panels);
  state.events.set(run, events);
  await Promise.all(keys.filter((k) => !state.series.has(`${run}|${k}`)).map((k) => fetchSeries(run, k)));
}

async function loadSelection() {
  await Promise.all([...state.selected].map(loadRun));
  draw();
}

async function refetchVisible() {
  const jobs = [];
  for (const run of state.selected) for (const key of state.keys.get(run) || []) jobs.push(fetchSeries(run, key));
  await Promise.all(jobs);
  const label = document.getElementById("zoom-range");
  label.textContent = state.zoom ? `steps ${state.zoom[0]}–${state.zoom[1]}` : "";
  draw();
}

async function followLive(run) {
  // Only what is new: keys not seen yet in full, known keys after the last step held.
  const keys = await getJSON(`api/runs/${run}/keys`);
  state.keys.set(run, keys);
  state.panels.set(run, await getJSON(`api/runs/${run}/panels`));
  state.events.set(run, await getJSON(`api/runs/${run}/events`));
  let changed = false;
  await Promise.all(
    keys.map(async (key) => {
      const held = state.series.get(`${run}|${key}`);
      if (!held) {
        await fetchSeries(run, key);
        changed = true;
        return;
      }
      const fresh = await getJSON(metricsURL(run, key, { after: held.lastStep }));
      if (!fresh.steps.length) return;
      held.lastStep = fresh.steps[fresh.steps.length - 1];
      if (!state.zoom || held.lastStep <= state.zoom[1]) {
        held.steps = held.steps.concat(fresh.steps);
        held.values = held.values.concat(fresh.values);
      }
      changed = true;
    }),
  );
  return changed;
}

async function tick() {
  if (state.busy) return;
  state.busy = true;
  try {
    const before = new Map(state.runs.map((r) => [r.id, r]));
    state.runs = await getJSON("api/runs");
    document.getElementById("db-status").textContent = `${state.runs.length} runs`;
    let redraw = false;
    for (const run of state.runs) {
      const old = before.get(run.id);
      const moved = !old || old.steps !== run.steps || old.status !== run.status;
      const entry = state.summaries.get(run.id);
      if (!entry || (moved && Date.now() - entry.time > SUMMARY_MS) || (old && old.status !== run.status)) {
        state.summaries.set(run.id, { time: Date.now(), summary: await getJSON(`api/runs/${run.id}/summary`) });
      }
      if (state.selected.has(run.id) && old && moved && (await followLive(run.id))) redraw = true;
    }
    renderTable();
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

function seriesStyle(run, key, runIndex) {
  const color = PALETTE[runIndex % PALETTE.length];
  const evaluating = key.startsWith("eval_");
  return {
    stroke: color,
    width: key === "step_loss" ? 1 : 2,
    dash: evaluating ? [6, 4] : undefined,
    alpha: key === "step_loss" ? 0.75 : 1,
    points: { show: key === "loss" || evaluating || key.startsWith("train_"), size: 4, stroke: color },
  };
}

function panels() {
  const byPanel = new Map();
  const runs = [...state.selected].sort((a, b) => a - b);
  runs.forEach((run, runIndex) => {
    for (const key of state.keys.get(run) || []) {
      const held = state.series.get(`${run}|${key}`);
      if (!held) continue;
      const name = panelOf(run, key);
      if (!byPanel.has(name)) byPanel.set(name, []);
      const info = runById(run);
      const label = runs.length > 1 ? `${run}:${info ? info.name : run} ${key}` : key;
      byPanel.get(name).push({ run, key, label, held, style: seriesStyle(run, key, runIndex) });
    }
  });
  return new Map([...byPanel].sort((a, b) => panelOrder(a[0]) - panelOrder(b[0]) || a[0].localeCompare(b[0])));
}

function chartData(entries) {
  const tables = entries.map((e) => {
    let values = smooth(e.held.values, state.smoothing);
    if (state.logY) values = values.map((v) => (v !== null && v > 0 ? v : null));
    return [e.held.steps, values];
  });
  return tables.length === 1 ? tables[0] : uPlot.join(tables);
}

function eventMarkers(entries) {
  const runs = new Set(entries.map((e) => e.run));
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          ctx.save();
          for (const run of runs) {
            for (const ev of state.events.get(run) || []) {
              if (ev.step === null) continue;
              const x = Math.round(u.valToPos(ev.step, "x", true));
              if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
              ctx.strokeStyle = EVENT_COLORS[ev.kind] || (ev.level === "warning" || ev.level === "error" ? EVENT_COLORS.alert : "#8c959f");
              ctx.lineWidth = 1;
              ctx.setLineDash([2, 3]);
              ctx.beginPath();
              ctx.moveTo(x, u.bbox.top);
              ctx.lineTo(x, u.bbox.top + u.bbox.height);
              ctx.stroke();
            }
          }
          ctx.restore();
        },
      ],
    },
  };
}

function noteDrawn(div, u) {
  let points = 0;
  for (let i = 1; i < u.data.length; i++) for (const v of u.data[i]) if (v !== null && v !== undefined) points++;
  const xs = u.data[0];
  div.dataset.points = points;
  div.dataset.lastStep = xs.length ? xs[xs.length - 1] : -1;
  div.dataset.series = u.series.slice(1).map((s) => s.label).join("|");
  if (window.__stepwatch.firstDraw === null && points > 0) window.__stepwatch.firstDraw = performance.now();
}

function chartWidth(div) {
  return Math.max(300, div.clientWidth - 12);
}

function makeChart(name, entries, div) {
  const opts = {
    width: chartWidth(div),
    height: 260,
    scales: { x: { time: false }, y: state.logY ? { distr: 3 } : {} },
    axes: [{ label: "step" }, { size: 60, values: (u, splits) => splits.map(fmtTick) }],
    cursor: { drag: { x: true, y: false, setScale: false }, sync: { key: "steps" } },
    legend: { live: true },
    series: [{ label: "step" }, ...entries.map((e) => ({ label: e.label, spanGaps: true, ...e.style }))],
    plugins: [eventMarkers(entries)],
    hooks: {
      draw: [(u) => noteDrawn(div, u)],
      setSelect: [
        (u) => {
          if (u.select.width < 4) return;
          const lo = Math.floor(u.posToVal(u.select.left, "x"));
          const hi = Math.ceil(u.posToVal(u.select.left + u.select.width, "x"));
          u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
          state.zoom = [lo, hi];
          refetchVisible().catch(showError);
        },
      ],
    },
  };
  const plot = new uPlot(opts, chartData(entries), div.querySelector(".plot"));
  plot.over.addEventListener("dblclick", () => {
    if (!state.zoom) return;
    state.zoom = null;
    refetchVisible().catch(showError);
  });
  return plot;
}

function draw() {
  const container = document.getElementById("charts");
  const wanted = panels();
  for (const [name, chart] of state.charts) {
    if (!wanted.has(name)) {
      chart.plot.destroy();
      chart.div.remove();
      state.charts.delete(name);
    }
  }
  for (const [name, entries] of wanted) {
    const labels = entries.map((e) => e.label).join("|") + (state.logY ? "|log" : "");
    let chart = state.charts.get(name);
    if (chart && chart.labels !== labels) {
      chart.plot.destroy();
      chart.div.remove();
      chart = undefined;
    }
    if (!chart) {
      const div = document.createElement("div");
      div.className = "chart";
      div.dataset.panel = name;
      div.innerHTML = `<h3>${escapeHTML(name)}</h3><div class="plot"></div>`;
      container.appendChild(div);
      chart = { div, labels, plot: makeChart(name, entries, div) };
      state.charts.set(name, chart);
    } else {
      chart.plot.setData(chartData(entries), !state.zoom);
    }
    if (state.zoom) chart.plot.setScale("x", { min: state.zoom[0], max: state.zoom[1] });
  }
  // Keep the panels in their order.
  for (const name of wanted.keys()) container.appendChild(state.charts.get(name).div);
  renderEvents();
}

function renderEvents() {
  const items = [];
  for (const run of [...state.selected].sort((a, b) => a - b)) {
    for (const ev of (state.events.get(run) || []).slice(-20)) {
      const li = document.createElement("li");
      const where = ev.step === null ? "" : ` step ${ev.step}`;
      li.textContent = `run ${run}${where} [${ev.kind}] ${ev.message}`;
      items.push(li);
    }
  }
  document.getElementById("events").replaceChildren(...items);
}

// -- start ----------------------------------------------------------------------------------
function setupControls() {
  const slider = document.getElementById("smoothing");
  slider.addEventListener("input", () => {
    state.smoothing = Number(slider.value);
    document.getElementById("smoothing-value").textContent = slider.value;
    draw();
  });
  document.getElementById("log-y").addEventListener("change", (ev) => {
    state.logY = ev.target.checked;
    draw();
  });
  document.getElementById("select-all").addEventListener("change", (ev) => {
    state.selected = ev.target.checked ? new Set(state.runs.map((r) => r.id)) : new Set();
    selectionChanged();
  });
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      for (const chart of state.charts.values()) chart.plot.setSize({ width: chartWidth(chart.div), height: 260 });
    }, 100);
  });
}

async function start() {
  setupControls();
  state.runs = await getJSON("api/runs");
  const asked = new URLSearchParams(location.search).get("runs");
  const known = new Set(state.runs.map((r) => r.id));
  if (asked) for (const id of asked.split(",").map(Number)) if (known.has(id)) state.selected.add(id);
  if (!state.selected.size && state.runs.length) state.selected.add(state.runs[state.runs.length - 1].id);
  renderTable();
  document.getElementById("db-status").textContent = `${state.runs.length} runs`;
  await loadSelection();
  setInterval(tick, POLL_MS);
}

start().catch(showError);
