// Conversations and settings, kept in localStorage.
//
// Keys:
//   xinfer.ui.conversations.v1  {"version": 1, "conversations": [Conversation, ...]}
//   xinfer.ui.current.v1        id of the open conversation
//   xinfer.ui.settings.v1       Settings
//
// Conversation: {id, title, created, updated, messages: [Message, ...]}
// Message: {id, role: "user"|"assistant", content, reasoning?, model?,
//           stats?, error?: {kind, message, status}, stopped?,
//           unsent? (a user message the context refused: shown, not sent again)}

import { uid } from './util.js';

const CONV_KEY = 'xinfer.ui.conversations.v1';
const CURRENT_KEY = 'xinfer.ui.current.v1';
const SETTINGS_KEY = 'xinfer.ui.settings.v1';

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: '',
  temperature: 0.7,
  topP: 0.95,
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

/** Thrown (and reported by the page) when localStorage is full or unavailable. */
export class StorageError extends Error {}

function writeJSON(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    throw new StorageError(e && e.name === 'QuotaExceededError'
      ? 'Browser storage is full: delete or export old conversations.'
      : 'Could not save to browser storage.');
  }
}

function validMessage(m) {
  return m && (m.role === 'user' || m.role === 'assistant') && typeof m.content === 'string';
}

function fixMessage(m) {
  const out = { ...m, id: typeof m.id === 'string' && m.id ? m.id : uid() };
  if (out.pending) {
    // Saved while streaming (page closed or reloaded mid-reply): the stream is gone.
    delete out.pending;
    out.stopped = true;
  }
  return out;
}

function normalise(c) {
  if (!c || typeof c !== 'object' || !Array.isArray(c.messages)) return null;
  const now = Date.now();
  return {
    id: typeof c.id === 'string' && c.id ? c.id : uid(),
    title: typeof c.title === 'string' && c.title.trim() ? c.title.slice(0, 200) : 'Untitled',
    created: Number(c.created) || now,
    updated: Number(c.updated) || Number(c.created) || now,
    messages: c.messages.filter(validMessage).map(fixMessage),
  };
}

export function loadSettings() {
  const s = readJSON(SETTINGS_KEY, {});
  return { ...DEFAULT_SETTINGS, ...(s && typeof s === 'object' ? s : {}) };
}

export function saveSettings(settings) {
  writeJSON(SETTINGS_KEY, settings);
}

export function loadConversations() {
  const data = readJSON(CONV_KEY, null);
  const list = data && Array.isArray(data.conversations) ? data.conversations : [];
  return list.map(normalise).filter(Boolean).sort((a, b) => b.updated - a.updated);
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

/** Parse an exported file: one conversation, a list, or {conversations: [...]}. */
export function parseImport(text) {
  const data = JSON.parse(text);
  const list = Array.isArray(data) ? data : Array.isArray(data && data.conversations) ? data.conversations : [data];
  const out = list.map(normalise).filter(Boolean);
  if (!out.length) throw new Error('No conversations found in this file.');
  return out;
}

export function titleFrom(text) {
  const line = (text || '').trim().split('\n')[0].replace(/\s+/g, ' ');
  return line.length > 60 ? line.slice(0, 57).trimEnd() + '…' : line || 'New chat';
}
