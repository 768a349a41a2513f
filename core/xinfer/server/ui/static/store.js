// Conversations and settings, kept in localStorage.
//
// Keys:
//   xinfer.ui.conversations.v1  {"version": 1, "conversations": [Conversation, ...]}
//   xinfer.ui.current.v1        id of the open conversation
//   xinfer.ui.settings.v1       Settings, with version: SETTINGS_VERSION
//
// Conversation: {id, title, created, updated, messages: [Message, ...]}
// Message: {id, role: "user"|"assistant", content, images? (data: URLs), reasoning?, model?,
//           stats?, error?: {kind, message, status, param}, stopped?,
//           unsent? (a user message the context refused: shown, not sent again),
//           omitted? (left out of requests: the conversation outgrew the context),
//           imagesRemoved? (how many images were dropped to free storage)}
// What is read back (or imported) is cleaned to these fields and types: one bad
// message must not stop the page from loading.

import { clip, uid } from './util.js';

const CONV_KEY = 'xinfer.ui.conversations.v1';
const CURRENT_KEY = 'xinfer.ui.current.v1';
const SETTINGS_KEY = 'xinfer.ui.settings.v1';

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: '',
  temperature: null, // null: Auto, not sent (the server's default: its flags, else the model's generation_config.json)
  topP: null, // the same
  maxTokens: null, // null: let the server decide (up to the context left)
  theme: 'system', // or 'light', 'dark' (theme.js applies it)
});

function readJSON(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

/** Thrown (and reported by the page) when localStorage is full (`full`) or unavailable. */
export class StorageError extends Error {
  constructor(full) {
    super(full ? 'Browser storage is full: delete or export old conversations.' : 'Could not save to browser storage.');
    this.full = full;
  }
}

function writeJSON(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    throw new StorageError(!!e && (e.name === 'QuotaExceededError' || e.name === 'NS_ERROR_DOM_QUOTA_REACHED'));
  }
}

const STAT_NUMBERS = ['tps', 'ttftMs', 'thinkMs', 'promptTokens', 'cachedTokens', 'completionTokens', 'durationMs'];
const ERROR_KINDS = ['down', 'stream', 'api', 'overflow', 'images', 'auth'];

const isText = (x) => typeof x === 'string';
const isImageUrl = (x) => isText(x) && /^data:image\/[a-z0-9.+-]+[;,]/i.test(x); // never a URL the page would fetch

/** A message's text and images from its content: a string, or OpenAI's content parts. */
function contentOf(content) {
  if (isText(content)) return { text: content, images: [] };
  if (content === null || content === undefined) return { text: '', images: [] };
  if (typeof content === 'number' || typeof content === 'boolean') return { text: String(content), images: [] };
  if (!Array.isArray(content)) return null;
  const parts = content.filter((p) => p && typeof p === 'object');
  return {
    text: parts.filter((p) => isText(p.text)).map((p) => p.text).join('\n\n'),
    images: parts.map((p) => p.image_url && (isText(p.image_url) ? p.image_url : p.image_url.url)).filter(isImageUrl),
  };
}

function cleanStats(s) {
  if (!s || typeof s !== 'object') return null;
  const out = {};
  for (const key of STAT_NUMBERS) if (Number.isFinite(s[key]) && s[key] >= 0) out[key] = s[key];
  if (isText(s.finishReason)) out.finishReason = s.finishReason;
  if (s.approx === true) out.approx = true;
  return Object.keys(out).length ? out : null;
}

function cleanError(e) {
  if (isText(e)) return { kind: 'api', message: e };
  if (!e || typeof e !== 'object') return null;
  return {
    kind: ERROR_KINDS.includes(e.kind) ? e.kind : 'api',
    message: isText(e.message) ? e.message : 'The request failed.',
    status: Number.isInteger(e.status) ? e.status : null,
    param: isText(e.param) ? e.param : null,
  };
}

/** A stored or imported message with only the fields the page knows, each of its type; null if unusable. */
function cleanMessage(m) {
  if (!m || typeof m !== 'object' || (m.role !== 'user' && m.role !== 'assistant')) return null;
  const content = contentOf(m.content);
  if (!content) return null;
  const out = { id: isText(m.id) && m.id ? m.id : uid(), role: m.role, content: content.text };
  const images = content.images.concat(Array.isArray(m.images) ? m.images.filter(isImageUrl) : []);
  if (m.role === 'user' && images.length) out.images = images;
  if (m.role === 'user' && Number.isInteger(m.imagesRemoved) && m.imagesRemoved > 0) out.imagesRemoved = m.imagesRemoved;
  if (m.role === 'assistant' && isText(m.reasoning)) out.reasoning = m.reasoning;
  if (isText(m.model)) out.model = m.model;
  const stats = cleanStats(m.stats);
  if (stats) out.stats = stats;
  const error = cleanError(m.error);
  if (error && m.role === 'assistant') out.error = error;
  // Saved while streaming (page closed or reloaded mid-reply): the stream is gone.
  if (m.stopped === true || m.pending) out.stopped = true;
  if (m.unsent === true) out.unsent = true;
  if (m.omitted === true) out.omitted = true;
  return out;
}

/** `clean` of each item of `list`, leaving out those it rejects or fails on: one bad item never loses the rest. */
function cleanEach(list, clean) {
  const out = [];
  for (const item of list) {
    try {
      const cleaned = clean(item);
      if (cleaned) out.push(cleaned);
    } catch {
      // left out
    }
  }
  return out;
}

/** `items`, each given a new id where an earlier one has its id: the page finds conversations and messages by id. */
function withUniqueIds(items, taken = new Set()) {
  for (const item of items) {
    if (taken.has(item.id)) item.id = uid();
    taken.add(item.id);
  }
  return items;
}

const timeOf = (x) => (Number.isFinite(Number(x)) && Number(x) > 0 ? Number(x) : null);

/** A conversation from storage or a file, cleaned (see cleanMessage); null if it is none. */
function normalise(c) {
  if (!c || typeof c !== 'object' || !Array.isArray(c.messages)) return null;
  const now = Date.now();
  const created = timeOf(c.created) || now;
  return {
    id: isText(c.id) && c.id ? c.id : uid(),
    title: isText(c.title) && c.title.trim() ? clip(c.title, 200) : 'Untitled',
    created,
    updated: timeOf(c.updated) || created,
    messages: withUniqueIds(cleanEach(c.messages, cleanMessage)),
  };
}


/** Max tokens as the API takes it: an integer >= 1, or null for "let the server decide". */
export function maxTokensOf(x) {
  return Number.isInteger(x) && x >= 1 ? x : null;
}

/** The values each sampling setting can take (the API takes top_p in (0, 1]). */
export const SAMPLING_RANGE = Object.freeze({ temperature: [0, 2], topP: [0.01, 1] });

/** A sampling setting (`key` of SAMPLING_RANGE) as the API takes it: a number within its range, or null for Auto. */
export function samplingOf(key, x) {
  const [lo, hi] = SAMPLING_RANGE[key];
  return Number.isFinite(x) ? Math.min(hi, Math.max(lo, x)) : null;
}

// Settings saved without a version (before 2) always had a temperature and a top-p, by
// default 0.7 and 0.95: those two values, which hardly anyone chose, are read as Auto.
const SETTINGS_VERSION = 2;
const OLD_DEFAULTS = { temperature: 0.7, topP: 0.95 };

const THEMES = ['system', 'light', 'dark'];

/** The saved settings, each field of its type, else its default: they may be written by hand or by an older page. */
export function loadSettings() {
  const s = readJSON(SETTINGS_KEY, {});
  const stored = s && typeof s === 'object' ? s : {};
  const settings = {
    systemPrompt: isText(stored.systemPrompt) ? stored.systemPrompt : DEFAULT_SETTINGS.systemPrompt,
    maxTokens: maxTokensOf(stored.maxTokens),
    theme: THEMES.includes(stored.theme) ? stored.theme : DEFAULT_SETTINGS.theme,
  };
  for (const key of Object.keys(SAMPLING_RANGE)) {
    const old = !(stored.version >= SETTINGS_VERSION) && stored[key] === OLD_DEFAULTS[key];
    settings[key] = old ? null : samplingOf(key, stored[key]);
  }
  return settings;
}

export function saveSettings(settings) {
  writeJSON(SETTINGS_KEY, { ...settings, version: SETTINGS_VERSION });
}

export function loadConversations() {
  const data = readJSON(CONV_KEY, null);
  const list = data && Array.isArray(data.conversations) ? data.conversations : [];
  return withUniqueIds(cleanEach(list, normalise)).sort((a, b) => b.updated - a.updated);
}

export function saveConversations(list) {
  writeJSON(CONV_KEY, { version: 1, conversations: list });
}

export function loadCurrentId() {
  try {
    return localStorage.getItem(CURRENT_KEY);
  } catch {
    return null;
  }
}

export function saveCurrentId(id) {
  try {
    if (id) localStorage.setItem(CURRENT_KEY, id);
    else localStorage.removeItem(CURRENT_KEY);
  } catch {
    // not important enough to report
  }
}

export function isConversationsKey(key) {
  return key === CONV_KEY;
}

export function isSettingsKey(key) {
  return key === SETTINGS_KEY;
}

export function newConversation() {
  const now = Date.now();
  return { id: uid(), title: 'New chat', created: now, updated: now, messages: [] };
}

/**
 * Parse an exported file: one conversation, a list, or {conversations: [...]}. Ids are made
 * unique within the file and against `taken` (those of the conversations already here).
 */
export function parseImport(text, taken = []) {
  const data = JSON.parse(text);
  const list = Array.isArray(data) ? data : Array.isArray(data && data.conversations) ? data.conversations : [data];
  const out = cleanEach(list, normalise);
  if (!out.length) throw new Error('No conversations found in this file.');
  return withUniqueIds(out, new Set(taken));
}

export function titleFrom(text) {
  const line = (text || '').trim().split('\n')[0].replace(/\s+/g, ' ');
  return clip(line, 60) || 'New chat';
}
