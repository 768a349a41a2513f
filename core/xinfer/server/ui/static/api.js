// Talking to the xInfer server: config, models, and streaming chat completions.
//
// All URLs are relative to the page, so the UI also works behind a reverse
// proxy that serves it under a path prefix.

let apiKey = null;

/** The server could not be reached (connection refused, DNS, dropped connection). */
export class ServerDownError extends Error {
  constructor(cause, message = 'Cannot reach the xInfer server.') {
    super(message);
    this.name = 'ServerDownError';
    this.cause = cause;
  }
}

/** The reply's stream was cut: the connection dropped, or closed without the closing [DONE]. */
export class StreamCutError extends ServerDownError {
  constructor(cause = null) {
    super(cause, 'The connection to the server closed before the reply was complete.');
    this.name = 'StreamCutError';
  }
}

/** The server answered with an error (HTTP status >= 400, or an error event in the stream). */
export class ApiError extends Error {
  constructor(status, message, type = null, code = null, param = null) {
    super(message || `Request failed with status ${status}`);
    this.name = 'ApiError';
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
  }

  /** A prompt that does not fit the model's context window. */
  get contextOverflow() {
    const msg = (this.message || '').toLowerCase();
    if (this.code === 'context_length_exceeded') return true;
    return (this.status === 400 || this.status === 413 || this.status === 0) &&
      /too long|context length|context window|maximum context|max_model_len|exceeds the model|too many tokens|context is \d+ tokens/.test(msg);
  }

  /** The engine is still loading its model (it takes requests once it has). */
  get modelLoading() {
    return this.status === 503 && /\bis loading\b/i.test(this.message || ''); // not "dead: loading failed"
  }

  /** An image in the conversation was refused (e.g. by a model that takes text only). */
  get imageRefused() {
    return this.status === 400 && /image/i.test(`${this.param || ''} ${this.message || ''}`);
  }
}

function headers(extra = {}) {
  const h = { ...extra };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function fetchOnce(url, init) {
  try {
    return await fetch(url, { ...init, headers: headers(init.headers) });
  } catch (e) {
    if (e && e.name === 'AbortError') throw e;
    throw new ServerDownError(e);
  }
}

/** Fetch `url`; a 401 is asked again once with the key the UI's config gives now (the server may have a new one). */
async function request(url, init = {}) {
  const res = await fetchOnce(url, init);
  if (res.status !== 401) return res;
  const before = apiKey;
  try {
    await loadConfig();
  } catch {
    return res;
  }
  return apiKey === before ? res : fetchOnce(url, init);
}

/** Build an ApiError from a failed Response: `{"error": {...}}`, FastAPI's `{"detail": ...}` or text. */
export async function errorFromResponse(res) {
  let text = '';
  try {
    text = await res.text();
  } catch {
    text = '';
  }
  let message = '';
  let type = null;
  let code = null;
  let param = null;
  try {
    const body = JSON.parse(text);
    const err = body && body.error;
    if (err && typeof err === 'object') {
      message = err.message || '';
      type = err.type || null;
      code = err.code ?? null;
      param = err.param ?? null;
    } else if (typeof err === 'string') {
      message = err;
    } else if (body && typeof body.detail === 'string') {
      message = body.detail;
    } else if (body && Array.isArray(body.detail)) {
      message = body.detail.map((d) => [Array.isArray(d.loc) ? d.loc.join('.') : '', d.msg].filter(Boolean).join(': ')).join('; ');
    } else if (body && typeof body.message === 'string') {
      message = body.message;
    }
  } catch {
    message = plainText(text).slice(0, 500);
  }
  if (!message) message = `${res.status} ${res.statusText || 'error'}`.trim();
  return new ApiError(res.status, message, type, code, param);
}

/** The text of an error page (a proxy's HTML answer), without its markup. */
function plainText(text) {
  return text.replace(/<(script|style)\b[\s\S]*?<\/\1\s*>/gi, ' ').replace(/<[^>]*>/g, ' ').replace(/\s+/g, ' ').trim();
}

/** Load `/ui/config.json` (the API key, if any). */
export async function loadConfig() {
  const res = await fetchOnce('ui/config.json', { cache: 'no-store' });
  if (!res.ok) throw await errorFromResponse(res);
  const cfg = await res.json();
  apiKey = cfg && cfg.api_key ? String(cfg.api_key) : null;
  return cfg;
}

/** List models: [{id, maxModelLen, images}, ...] (images: it takes images, per input_modalities). */
export async function listModels(signal) {
  const res = await request('v1/models', { signal, cache: 'no-store' });
  if (!res.ok) throw await errorFromResponse(res);
  const body = await res.json();
  return (body && Array.isArray(body.data) ? body.data : []).map((m) => ({
    id: String(m.id),
    maxModelLen: Number(m.max_model_len || m.context_length || m.max_context_length || 0) || null,
    images: Array.isArray(m.input_modalities) && m.input_modalities.includes('image'),
  }));
}

/**
 * The engine's state from `/health`: {ready, status, error}. Only a 503 (loading,
 * draining, dead) is not ready: a server without the route, or behind a proxy that
 * guards it, counts as ready.
 */
export async function serverHealth() {
  const res = await request('health', { cache: 'no-store' });
  if (res.status !== 503) return { ready: true, status: 'ok', error: null };
  let body = {};
  try {
    body = await res.json();
  } catch {
    body = {};
  }
  return { ready: false, status: String((body && body.status) || res.status), error: (body && body.error) || null };
}

/**
 * Parse a stream of Server-Sent Events from a fetch Response body.
 * Yields the `data` of each event as a string (multi-line data joined by "\n").
 */
export async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (e) {
        if (e && e.name === 'AbortError') throw e;
        throw new StreamCutError(e); // the connection dropped mid-stream
      }
      if (chunk.done) break;
      buf += decoder.decode(chunk.value, { stream: true });
      // Normalise line endings, keeping a trailing "\r" until we know whether "\n" follows.
      const keepCR = buf.endsWith('\r');
      if (keepCR) buf = buf.slice(0, -1);
      buf = buf.replace(/\r\n?/g, '\n');
      let sep;
      while ((sep = buf.indexOf('\n\n')) !== -1) {
        const block = buf.slice(0, sep);
        buf = buf.slice(sep + 2);
        const data = eventData(block);
        if (data !== null) yield data;
      }
      if (keepCR) buf += '\r';
    }
    buf += decoder.decode();
    const data = eventData(buf.replace(/\r\n?/g, '\n'));
    if (data !== null) yield data;
  } finally {
    try { reader.releaseLock(); } catch { /* already released */ }
  }
}

function eventData(block) {
  const lines = [];
  for (const line of block.split('\n')) {
    if (line.startsWith('data:')) lines.push(line.slice(line[5] === ' ' ? 6 : 5));
  }
  return lines.length ? lines.join('\n') : null;
}

/**
 * POST /v1/chat/completions with stream=true and yield the parsed chunks.
 * Throws ServerDownError, ApiError, or an AbortError when `signal` aborts.
 */
export async function* streamChat(payload, signal) {
  const res = await request('v1/chat/completions', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Accept: 'text/event-stream' },
    body: JSON.stringify({ ...payload, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!res.ok) throw await errorFromResponse(res);
  const type = res.headers.get('content-type') || '';
  if (!type.includes('text/event-stream')) {
    // A server that ignored stream=true: treat the JSON body as one chunk.
    const body = await res.json();
    if (body && body.error) throw new ApiError(res.status, body.error.message || String(body.error));
    const choice = body.choices && body.choices[0];
    if (choice && choice.message) {
      yield { choices: [{ index: 0, delta: choice.message, finish_reason: choice.finish_reason }], usage: body.usage };
    }
    return;
  }
  for await (const data of sseEvents(res.body)) {
    if (data.trim() === '[DONE]') return;
    let obj;
    try {
      obj = JSON.parse(data);
    } catch {
      continue; // not JSON: ignore (keep-alive, comment-like data)
    }
    if (obj && obj.error) {
      const e = obj.error;
      throw new ApiError(e.code && Number.isInteger(e.code) ? e.code : 0,
        typeof e === 'string' ? e : e.message, e.type, e.code, e.param);
    }
    yield obj;
  }
  // Every stream ends with [DONE]: without it the connection was cut (a server or proxy that died).
  throw new StreamCutError();
}
