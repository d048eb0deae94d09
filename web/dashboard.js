// Live latency dashboard: polls GET /v1/stats once a second and draws it on canvases.
// State for tests and debugging: window.dashboardState = {updates, lastStats, error}.

const POLL_MS = 1000;
const LOAD_HISTORY = 300; // samples of the gauges this page keeps (the server sends no series for them)
const KEY_STORAGE = "tts-gateway.api_key";

const $ = (id) => document.getElementById(id);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

const state = { updates: 0, lastStats: null, error: null };
window.dashboardState = state;
const load = { t: [], sessions: [], contexts: [], queue: [] };

const keyInput = $("api_key");
keyInput.value = localStorage.getItem(KEY_STORAGE) ?? "";
keyInput.addEventListener("change", () => {
  localStorage.setItem(KEY_STORAGE, keyInput.value);
  poll();
});
$("window").addEventListener("change", () => poll());

async function fetchStats() {
  const params = new URLSearchParams({ window: $("window").value });
  // A typed key, else a token the page was given (`/dashboard?token=…`, from POST /v1/tokens).
  const credential = keyInput.value || new URLSearchParams(location.search).get("token");
  const headers = credential ? { Authorization: `Bearer ${credential}` } : {};
  const response = await fetch(`/v1/stats?${params}`, { headers, cache: "no-store" });
  if (response.status === 401) throw new Error("API key required or wrong");
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  return response.json();
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const stats = await fetchStats();
    state.lastStats = stats;
    state.error = null;
    state.updates += 1;
    render(stats);
    setStatus("live", "ok");
  } catch (error) {
    state.error = String(error.message ?? error);
    setStatus(state.error, "bad");
  } finally {
    polling = false;
  }
}

function setStatus(text, kind) {
  const pill = $("status");
  pill.textContent = text;
  pill.className = `pill ${kind}`;
}

// ------------------------------------------------------------------ rendering

const fmtNum = (v) => String(+v.toFixed(2));
const fmtMs = (ms) => (ms == null ? "–" : ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`);

function render(stats) {
  const c = stats.current;
  $("ttfa_p50").textContent = fmtMs(c.ttfa_p50_ms);
  $("ttfa_p95").textContent = fmtMs(c.ttfa_p95_ms);
  $("sessions").textContent = c.sessions;
  $("contexts").textContent = c.contexts;
  $("queue").textContent = c.engine_queue_depth;
  $("running").textContent = c.engine_running;
  $("stall").textContent = `${c.stall_s.toFixed(2)} s`;

  for (const [key, value] of [["t", Math.floor(stats.now)], ["sessions", c.sessions],
                               ["contexts", c.contexts], ["queue", c.engine_queue_depth]]) {
    load[key].push(value);
    if (load[key].length > LOAD_HISTORY) load[key].shift();
  }

  const s = stats.series;
  drawChart($("chart_ttfa"), s.t, [[s.ttfa_p50_ms, css("--p50")], [s.ttfa_p95_ms, css("--p95")]], fmtMs);
  drawChart($("chart_load"), load.t, [[load.sessions, css("--p50")], [load.contexts, css("--ok")],
                                      [load.queue, css("--p95")]], fmtNum);
  drawChart($("chart_audio"), s.t, [[s.audio_s_per_s, css("--ok")]], fmtNum);
  drawChart($("chart_stall"), s.t, [[s.stall_s, css("--p95")]], fmtNum);
  drawChart($("chart_errors"), s.t, [[s.errors, css("--bad")]], fmtNum);
  renderTable($("errors"), Object.entries(c.errors_by_code).sort((a, b) => b[1] - a[1]), "no errors in the window");
  renderGpu(stats.gpu);
}

function renderTable(table, rows, empty) {
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const [name, value] of rows.length ? rows : [[empty, ""]]) {
    const tr = body.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = value;
  }
}

function renderGpu(gpu) {
  const table = $("gpu");
  table.classList.toggle("none", !gpu);
  if (!gpu) return renderTable(table, [], "no GPU");
  const rows = [];
  if (gpu.gpu_utilization_ratio != null) rows.push(["utilisation", `${(gpu.gpu_utilization_ratio * 100).toFixed(0)} %`]);
  if (gpu.gpu_memory_used_bytes != null) {
    const gib = (b) => (b / 2 ** 30).toFixed(1);
    const total = gpu.gpu_memory_total_bytes ? ` / ${gib(gpu.gpu_memory_total_bytes)}` : "";
    rows.push(["memory", `${gib(gpu.gpu_memory_used_bytes)}${total} GiB`]);
  }
  if (gpu.gpu_temperature_celsius != null) rows.push(["temperature", `${gpu.gpu_temperature_celsius.toFixed(0)} °C`]);
  renderTable(table, rows, "no GPU");
}

// One time axis (unix seconds), one or more series; null values leave gaps.
function drawChart(canvas, ts, series, fmt) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * dpr)) canvas.width = Math.round(width * dpr);
  if (canvas.height !== Math.round(height * dpr)) canvas.height = Math.round(height * dpr);
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, width, height);

  const left = 56, right = 8, top = 8, bottom = 18;
  const w = width - left - right, h = height - top - bottom;
  const values = series.flatMap(([ys]) => ys.filter((v) => v != null));
  const max = niceMax(Math.max(0, ...values));
  const x = (i) => left + (ts.length > 1 ? (i / (ts.length - 1)) * w : w);
  const y = (v) => top + h - (v / max) * h;

  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = css("--line");
  g.fillStyle = css("--dim");
  g.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = (max * k) / 4;
    g.beginPath();
    g.moveTo(left, Math.round(y(v)) + 0.5);
    g.lineTo(left + w, Math.round(y(v)) + 0.5);
    g.stroke();
    g.textAlign = "right";
    g.fillText(fmt(v), left - 6, y(v) + 4);
  }
  if (ts.length > 1) {
    g.textAlign = "left";
    g.fillText(`-${ts.at(-1) - ts[0]} s`, left, height - 4);
    g.textAlign = "right";
    g.fillText("now", left + w, height - 4);
  }

  g.lineWidth = 2;
  for (const [ys, color] of series) {
    g.strokeStyle = color;
    g.fillStyle = color;
    g.beginPath();
    let drawing = false;
    ys.forEach((v, i) => {
      if (v == null) { drawing = false; return; }
      if (drawing) g.lineTo(x(i), y(v));
      else { g.moveTo(x(i), y(v)); drawing = true; }
      // Sparse points (one TTFA in a minute) stay visible as dots.
      const lone = (i === 0 || ys[i - 1] == null) && (i === ys.length - 1 || ys[i + 1] == null);
      if (lone) g.fillRect(x(i) - 2, y(v) - 2, 4, 4);
    });
    g.stroke();
  }
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v);
}

poll();
setInterval(poll, POLL_MS);
