// AudioWorklet player: one FIFO of chunks (tagged with their context), a small jitter
// buffer before each context starts, linear resampling to the AudioContext's rate.
//
// Messages in:  {type:"push", id, samples: Float32Array, rate}
//               {type:"end", id}     no more audio will come for this context
//               {type:"clear", id}   drop the context's buffered audio now (barge-in)
// Messages out: {type:"stats", contexts: {id: {played, underruns, buffered, finished}}, peaks}
//   played: source samples consumed; underruns: render quanta with an empty buffer after
//   the context started playing and before its audio ended; peaks: [min, max] per quantum.

const PREBUFFER_MS = 60;
const REPORT_EVERY = 8; // render quanta (~20 ms at 48 kHz)

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];        // {id, data, rate, pos}
    this.contexts = new Map(); // id -> {played, underruns, buffered (s), started, ended, finished}
    this.current = null;    // id of the context playing now
    this.peaks = [];
    this.quanta = 0;
    this.dirty = new Set();
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  ctx(id) {
    let c = this.contexts.get(id);
    if (!c) {
      c = { played: 0, underruns: 0, buffered: 0, started: false, ended: false, finished: false };
      this.contexts.set(id, c);
    }
    return c;
  }

  onMessage(msg) {
    const c = this.ctx(msg.id);
    if (msg.type === "push") {
      if (c.finished) return;
      this.queue.push({ id: msg.id, data: msg.samples, rate: msg.rate, pos: 0 });
      c.buffered += msg.samples.length / msg.rate;
    } else if (msg.type === "end") {
      c.ended = true;
    } else if (msg.type === "clear") {
      this.queue = this.queue.filter((item) => item.id !== msg.id);
      c.buffered = 0;
      c.ended = true;
      c.finished = true;
      if (this.current === msg.id) this.current = null;
    }
    this.dirty.add(msg.id);
  }

  // The context to play next: the current one, else the head of the queue once its
  // jitter buffer is full (or its audio is complete).
  pick() {
    if (this.current !== null) return this.current;
    if (!this.queue.length) return null;
    const id = this.queue[0].id;
    const c = this.ctx(id);
    if (c.buffered * 1000 >= PREBUFFER_MS || c.ended) {
      c.started = true;
      this.current = id;
      return id;
    }
    return null;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let lo = 0, hi = 0;
    let i = 0;
    while (i < out.length) {
      const id = this.pick();
      if (id === null) break;
      const c = this.ctx(id);
      const item = this.queue[0];
      if (!item || item.id !== id) {
        // The current context has no audio buffered.
        if (c.ended) { c.finished = true; this.current = null; this.dirty.add(id); continue; }
        c.underruns += 1;
        this.dirty.add(id);
        break;
      }
      const step = item.rate / sampleRate;
      const next = this.queue[1];
      for (; i < out.length && item.pos < item.data.length; i++) {
        const k = Math.floor(item.pos);
        const frac = item.pos - k;
        const s0 = item.data[k];
        const s1 = k + 1 < item.data.length ? item.data[k + 1]
          : (next && next.id === id ? next.data[0] : s0);
        const s = s0 + (s1 - s0) * frac;
        out[i] = s;
        if (s < lo) lo = s;
        if (s > hi) hi = s;
        item.pos += step;
        c.played += step;
        c.buffered -= 1 / sampleRate;
      }
      if (item.pos >= item.data.length) {
        this.queue.shift();
        if (next && next.id === id) next.pos = item.pos - item.data.length;
      }
      this.dirty.add(id);
    }
    for (; i < out.length; i++) out[i] = 0;
    this.peaks.push(lo, hi);
    if (++this.quanta % REPORT_EVERY === 0) this.report();
    return true;
  }

  report() {
    if (!this.dirty.size && !this.peaks.length) return;
    const contexts = {};
    for (const id of this.dirty) {
      const c = this.ctx(id);
      contexts[id] = {
        played: Math.floor(c.played), underruns: c.underruns,
        buffered: Math.max(0, c.buffered), finished: c.finished,
      };
    }
    this.port.postMessage({ type: "stats", contexts, peaks: this.peaks });
    this.dirty = new Set();
    this.peaks = [];
  }
}

registerProcessor("tts-player", Player);
