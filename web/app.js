// Minimal browser client for the gateway: one context at a time, 24 kHz float PCM,
// each chunk scheduled right after the previous one on the Web Audio clock.
const $ = (id) => document.getElementById(id);
const RATE = 24000;
let socket = null;
let audio = null;
let playAt = 0;
let sentAt = 0;
let contextSeq = 0;

function log(line) { $("log").textContent += line + "\n"; }

function connect() {
  return new Promise((resolve, reject) => {
    const url = new URL("/v1/stream", location.href);
    url.protocol = url.protocol.replace("http", "ws");
    url.searchParams.set("sample_rate", RATE);
    url.searchParams.set("encoding", "pcm_f32le");
    if ($("key").value) url.searchParams.set("api_key", $("key").value);
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    ws.onmessage = (event) => onFrame(event.data, ws, resolve);
    ws.onerror = () => reject(new Error("connection failed (check the API key)"));
    ws.onclose = (event) => { log(`closed (${event.code}) ${event.reason}`); socket = null; };
  });
}

function onFrame(data, ws, resolve) {
  if (typeof data !== "string") { play(new Float32Array(data)); return; }
  const frame = JSON.parse(data);
  if (frame.type === "ready") { log(`ready: voice ${frame.voice}, session ${frame.session_id}`); resolve(ws); }
  else if (frame.type === "audio" && frame.seq === 0) log(`first audio after ${(performance.now() - sentAt).toFixed(0)} ms`);
  else if (frame.type === "done") { log(`done: ${frame.audio_ms} ms of audio, server TTFA ${frame.ttfa_ms} ms`); $("stop").disabled = true; }
  else if (frame.type === "cancelled") { log("cancelled"); $("stop").disabled = true; }
  else if (frame.type === "error") log(`error ${frame.code}: ${frame.message}`);
}

function play(samples) {
  const buffer = audio.createBuffer(1, samples.length, RATE);
  buffer.copyToChannel(samples, 0);
  const source = audio.createBufferSource();
  source.buffer = buffer;
  source.connect(audio.destination);
  playAt = Math.max(playAt, audio.currentTime + 0.05);
  source.start(playAt);
  playAt += buffer.duration;
}

$("speak").onclick = async () => {
  try {
    audio ??= new AudioContext({ sampleRate: RATE });
    await audio.resume();
    socket ??= await connect();
    const context_id = `c${++contextSeq}`;
    sentAt = performance.now();
    socket.send(JSON.stringify({ type: "text", context_id, text: $("text").value }));
    socket.send(JSON.stringify({ type: "end", context_id }));
    $("stop").disabled = false;
    $("stop").onclick = async () => {
      socket?.send(JSON.stringify({ type: "cancel", context_id }));
      await audio.close();  // drop what is already scheduled
      audio = null; playAt = 0;
    };
  } catch (err) { log(String(err)); }
};
