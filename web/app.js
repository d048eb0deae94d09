// Browser voice client for tts-gateway (protocol v1, docs/protocol.md).
// One WebSocket session, one context per Speak / Simulate LLM, playback through an
// AudioWorklet (player-worklet.js) with a small jitter buffer, barge-in with Stop.
const $ = (id) => document.getElementById(id);

// State for people and tests: window.ttsState.contexts[id] = {chunks, bytes, ttfaBrowserMs,
// ttfaServerMs, framesPlayed, underruns, status, audioAfterCancel}.
const state = { contexts: {}, connected: false };
window.ttsState = state;
const local = new Map(); // id -> {sentAt, rate, encoding, mode, stopping, timer}

let socket = null;       // open WebSocket after `ready`
let connecting = null;   // Promise of the socket while connecting
let audio = null;        // AudioContext
let player = null;       // AudioWorkletNode
let header = null;       // audio header waiting for its binary frame
let contextSeq = 0;
// A short-lived token the page was given (`/?token=…`, minted by a backend with
// POST /v1/tokens): used when no API key is typed in, so the page never needs the key.
const pageToken = new URLSearchParams(location.search).get("token");

// ------------------------------------------------------------------ helpers

function log(line) {
  const el = $("log");
  el.textContent += `${new Date().toLocaleTimeString()}  ${line}\n`;
  el.scrollTop = el.scrollHeight;
}

function setConnected(on) {
  state.connected = on;
  $("conn").textContent = on ? "connected" : "disconnected";
  $("conn").className = on ? "pill on" : "pill off";
}

// Binary frame -> Float32 samples in [-1, 1].
function decode(buffer, encoding) {
  if (encoding === "pcm_f32le") return new Float32Array(buffer);
  const view = new DataView(buffer);
  if (encoding === "pcm_s16le") {
    const out = new Float32Array(buffer.byteLength >> 1);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32767;
    return out;
  }
  if (encoding === "mulaw") { // G.711 µ-law
    const codes = new Uint8Array(buffer);
    const out = new Float32Array(codes.length);
    for (let i = 0; i < codes.length; i++) {
      const u = ~codes[i] & 0xff;
      const magnitude = ((((u & 0x0f) << 3) + 0x84) << ((u >> 4) & 0x07)) - 0x84;
      out[i] = (u & 0x80 ? -magnitude : magnitude) / 32767;
    }
    return out;
  }
  throw new Error(`unknown encoding ${encoding}`);
}

// Deltas of ~4 characters, cut anywhere (mid-word), like an LLM's token stream.
function llmDeltas(text, size = 4) {
  const out = [];
  for (let i = 0; i < text.length; i += size) out.push(text.slice(i, i + size));
  return out;
}

// ------------------------------------------------------------------ connection

function connect() {
  if (socket) return Promise.resolve(socket);
  if (connecting) return connecting;
  connecting = new Promise((resolve, reject) => {
    const url = new URL("/v1/stream", location.href);
    url.protocol = url.protocol.replace("http", "ws");
    if ($("key").value) url.searchParams.set("api_key", $("key").value);
    else if (pageToken) url.searchParams.set("token", pageToken);
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    let ready = false;
    ws.onmessage = (event) => {
      if (!ready) {
        const frame = JSON.parse(event.data);
        if (frame.type !== "ready") { log(`refused: ${frame.code} ${frame.message}`); return; }
        ready = true;
        onReady(frame);
        socket = ws; connecting = null; setConnected(true);
        resolve(ws);
        return;
      }
      onFrame(event.data);
    };
    ws.onclose = (event) => {
      if (!ready) {
        connecting = null;
        reject(new Error(`connection refused (check the API key${pageToken ? " or get a new token" : ""})`));
        return;
      }
      log(`connection closed (${event.code}) ${event.reason}`);
      if (socket !== ws) return; // an older session (the API key changed)
      socket = null;
      setConnected(false);
      for (const [id, c] of Object.entries(state.contexts)) if (c.status === "speaking") finish(id, "error");
    };
  });
  return connecting;
}

function onReady(frame) {
  const select = $("voice");
  const chosen = select.value;
  select.replaceChildren(...frame.voices.map((v) => new Option(`${v.name} (${v.language}, ${v.engine})`, v.id)));
  select.value = frame.voices.some((v) => v.id === chosen) ? chosen : frame.voice;
  log(`ready: session ${frame.session_id}, ${frame.voices.length} voice(s)`);
}

// ------------------------------------------------------------------ frames

function onFrame(data) {
  if (typeof data !== "string") return onAudio(data);
  const frame = JSON.parse(data);
  const id = frame.context_id;
  const ctx = state.contexts[id];
  switch (frame.type) {
    case "audio": header = frame; break;
    case "done":
      if (!ctx) break;
      ctx.ttfaServerMs = frame.ttfa_ms;
      finish(id, ctx.status === "speaking" ? "done" : ctx.status);
      log(`${id}: done, ${frame.audio_ms.toFixed(0)} ms of audio, server TTFA ${frame.ttfa_ms?.toFixed(0)} ms`);
      break;
    case "cancelled":
      if (ctx) finish(id, "cancelled");
      log(`${id}: cancelled`);
      break;
    case "error":
      if (frame.code === "unknown_context" && ctx && ctx.status !== "speaking") break; // cancel crossed done
      log(`error ${frame.code}: ${frame.message}`);
      if (ctx && ctx.status === "speaking") finish(id, "error");
      break;
  }
  render();
}

function onAudio(buffer) {
  const h = header;
  header = null;
  const ctx = h && state.contexts[h.context_id];
  if (!ctx) return;
  const info = local.get(h.context_id);
  if (ctx.status === "cancelled") { ctx.audioAfterCancel += 1; return; }
  if (ctx.status !== "speaking") return;
  ctx.chunks += 1;
  ctx.bytes += buffer.byteLength;
  if (ctx.ttfaBrowserMs === null) ctx.ttfaBrowserMs = Math.round(performance.now() - info.sentAt);
  if (info.stopping) return; // cancel sent: drop what was already on the wire
  const samples = decode(buffer, info.encoding);
  player.port.postMessage({ type: "push", id: h.context_id, samples, rate: info.rate }, [samples.buffer]);
  render();
}

function finish(id, status) {
  const ctx = state.contexts[id];
  const info = local.get(id);
  clearInterval(info.timer);
  ctx.status = status;
  player?.port.postMessage({ type: status === "cancelled" ? "clear" : "end", id });
  $("stop").disabled = !Object.values(state.contexts).some((c) => c.status === "speaking");
  render();
}

// ------------------------------------------------------------------ audio

async function ensureAudio() {
  if (!audio) {
    audio = new AudioContext({ latencyHint: "interactive" });
    audio.resume(); // inside the click: browsers block autoplay otherwise
    await audio.audioWorklet.addModule("player-worklet.js");
    player = new AudioWorkletNode(audio, "tts-player", { numberOfInputs: 0, outputChannelCount: [1] });
    player.connect(audio.destination);
    player.port.onmessage = (event) => onPlayerStats(event.data);
  }
  await audio.resume();
}

function onPlayerStats(msg) {
  for (const [id, s] of Object.entries(msg.contexts)) {
    const ctx = state.contexts[id];
    if (!ctx) continue;
    ctx.framesPlayed = s.played;
    ctx.underruns = s.underruns;
  }
  wave.push(msg.peaks);
  render();
}

// A scrolling min/max envelope of what the worklet played, one column per render quantum.
const wave = {
  peaks: [],
  push(pairs) {
    for (let i = 0; i < pairs.length; i += 2) this.peaks.push([pairs[i], pairs[i + 1]]);
    const width = $("wave").width;
    if (this.peaks.length > width) this.peaks.splice(0, this.peaks.length - width);
    this.dirty = true;
  },
  draw() {
    const canvas = $("wave");
    const g = canvas.getContext("2d");
    const mid = canvas.height / 2;
    g.fillStyle = "#0f172a";
    g.fillRect(0, 0, canvas.width, canvas.height);
    g.fillStyle = "#334155";
    g.fillRect(0, mid, canvas.width, 1);
    g.fillStyle = "#38bdf8";
    const x0 = canvas.width - this.peaks.length;
    this.peaks.forEach(([lo, hi], i) => {
      const top = mid - Math.min(1, hi) * mid * 0.95;
      const bottom = mid - Math.max(-1, lo) * mid * 0.95;
      g.fillRect(x0 + i, top, 1, Math.max(1, bottom - top));
    });
    this.dirty = false;
  },
};

// ------------------------------------------------------------------ table

let renderQueued = false;
function render() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    if (wave.dirty) wave.draw();
    const ms = (v) => (v === null || v === undefined ? "–" : `${Math.round(v)} ms`);
    const rows = Object.entries(state.contexts).reverse().map(([id, c]) => {
      const info = local.get(id);
      const cells = [id, info.mode, `${info.encoding} @ ${info.rate}`, c.status, c.chunks,
        (c.bytes / 1024).toFixed(1), ms(c.ttfaBrowserMs), ms(c.ttfaServerMs),
        `${(c.framesPlayed / info.rate).toFixed(2)} s`, c.underruns];
      const tr = document.createElement("tr");
      tr.dataset.context = id;
      const names = ["id", "mode", "format", "status", "chunks", "kib", "ttfa-browser", "ttfa-server", "played", "underruns"];
      cells.forEach((value, i) => {
        const td = tr.insertCell();
        td.textContent = value;
        td.className = names[i] + (i === 3 ? ` status-${value}` : "");
      });
      return tr;
    });
    $("contexts").tBodies[0].replaceChildren(...rows);
  });
}

// ------------------------------------------------------------------ actions

async function start(mode) {
  const text = $("text").value;
  if (!text.trim()) return;
  let ws;
  try {
    await ensureAudio();
    ws = await connect();
  } catch (err) { log(String(err.message || err)); return; }
  const id = `c${++contextSeq}`;
  const info = {
    mode, rate: Number($("rate").value), encoding: $("encoding").value,
    sentAt: performance.now(), stopping: false, timer: null,
  };
  local.set(id, info);
  state.contexts[id] = {
    chunks: 0, bytes: 0, ttfaBrowserMs: null, ttfaServerMs: null,
    framesPlayed: 0, underruns: 0, status: "speaking", audioAfterCancel: 0,
  };
  const options = { sample_rate: info.rate, encoding: info.encoding };
  if ($("voice").value) options.voice = $("voice").value;
  const send = (frame) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify({ ...frame, context_id: id }));

  if (mode === "speak") {
    send({ type: "text", text, ...options });
    send({ type: "end" });
  } else {
    const deltas = llmDeltas(text);
    const tps = Math.max(1, Number($("tps").value) || 30);
    send({ type: "text", text: deltas.shift(), ...options });
    info.timer = setInterval(() => {
      if (deltas.length) send({ type: "text", text: deltas.shift() });
      if (!deltas.length) { clearInterval(info.timer); send({ type: "end" }); }
    }, 1000 / tps);
  }
  $("stop").disabled = false;
  log(`${id}: ${mode === "speak" ? "speak" : "simulated LLM"}, ${text.length} chars, ${info.encoding} @ ${info.rate} Hz`);
  render();
}

function stop() {
  for (const [id, c] of Object.entries(state.contexts)) {
    if (c.status !== "speaking") continue;
    const info = local.get(id);
    clearInterval(info.timer);
    info.stopping = true;
    socket?.send(JSON.stringify({ type: "cancel", context_id: id }));
    player?.port.postMessage({ type: "clear", id }); // drop buffered audio at once
  }
  $("stop").disabled = true;
}

$("speak").onclick = () => start("speak");
$("simulate").onclick = () => start("simulate");
$("stop").onclick = stop;
$("key").onchange = () => { socket?.close(); socket = null; };
connect().catch((err) => log(String(err.message || err)));
render();
