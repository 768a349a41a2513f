// xInfer chat UI: the page's main module.
//
// Model output is untrusted. It only reaches the DOM through markdown.js
// (text nodes, http(s)-only links) or through textContent; nothing here uses
// innerHTML.

import { ApiError, ServerDownError, StreamCutError, listModels, loadConfig, serverHealth, streamChat } from './api.js';
import { icon } from './icons.js';
import { renderMarkdown, splitThink } from './markdown.js';
import {
  DEFAULT_SETTINGS, StorageError, isConversationsKey, isSettingsKey, loadConversations, loadCurrentId, loadSettings,
  maxTokensOf, newConversation, parseImport, samplingOf, saveConversations, saveCurrentId, saveSettings, titleFrom,
} from './store.js';
import { clip, copyText, formatContext, formatInt, formatSeconds, h, relativeTime, uid } from './util.js';

const $ = (sel) => document.querySelector(sel);

const state = {
  convs: loadConversations(),
  currentId: loadCurrentId(),
  settings: loadSettings(),
  models: [],
  model: null, // {id, maxModelLen}
  online: null, // null: unknown yet
  serverStatus: null, // the engine's, from /health: 'ok', 'loading', 'draining', ...
  gens: new Map(), // conversation id -> its running generation {msg, controller, frame, timer, waiting}
  editingId: null, // id of the user message being edited
  attachments: [], // data: URLs of the images for the next message
};

const ui = {
  app: $('#app'),
  sidebar: $('#sidebar'),
  convList: $('#conv-list'),
  messages: $('#messages'),
  scroller: $('#scroller'),
  empty: $('#empty'),
  input: $('#input'),
  composer: $('#composer'),
  send: $('#send'),
  attach: $('#attach'),
  attachInput: $('#attach-input'),
  attachments: $('#attachments'),
  stop: $('#stop'),
  modelName: $('#model-name'),
  modelSelect: $('#model-select'),
  modelCtx: $('#model-ctx'),
  statusDot: $('#status-dot'),
  banner: $('#banner'),
  storageBanner: $('#storage-banner'),
  jump: $('#jump'),
  settings: $('#settings'),
  toasts: $('#toasts'),
  sysIndicator: $('#sys-indicator'),
};

// ------------------------------------------------------------------ utils ---

function toast(text, kind = 'info') {
  const t = h('div', { className: `toast ${kind}`, text, attrs: { role: kind === 'error' ? 'alert' : 'status' } });
  ui.toasts.appendChild(t);
  setTimeout(() => t.classList.add('out'), 2600);
  setTimeout(() => t.remove(), 3000);
}

function current() {
  return state.convs.find((c) => c.id === state.currentId) || null;
}

/** Whether a reply is streaming into `conv` (each conversation streams on its own). */
function busy(conv) {
  return !!conv && state.gens.has(conv.id);
}

let saveTimer = null;
function persist({ soon = false } = {}) {
  const write = () => {
    saveTimer = null;
    saveAll();
  };
  if (soon) {
    if (!saveTimer) saveTimer = setTimeout(write, 750);
    return;
  }
  if (saveTimer) clearTimeout(saveTimer);
  write();
}

/** Save the conversations; when storage is full, drop the images of the oldest ones to make room. */
function saveAll() {
  let freed = 0;
  for (;;) {
    try {
      saveConversations(state.convs);
      break;
    } catch (e) {
      if (e instanceof StorageError && e.full && dropOldestImages()) { freed += 1; continue; }
      setStorageWarning(e instanceof StorageError ? e.message : String(e));
      return;
    }
  }
  setStorageWarning(null);
  if (freed) toast(`Browser storage was full: images were removed from ${freed} older conversation${freed > 1 ? 's' : ''} to make room.`);
}

/** Drop the images (the bulk of what is stored) of the least recent conversation that has some, but the open one. */
function dropOldestImages() {
  const withImages = state.convs.filter((c) => c.id !== state.currentId && !busy(c) && c.messages.some((m) => m.images));
  const oldest = withImages.sort((a, b) => a.updated - b.updated)[0];
  if (!oldest) return false;
  for (const m of oldest.messages) {
    if (!m.images) continue;
    m.imagesRemoved = (m.imagesRemoved || 0) + m.images.length;
    delete m.images;
  }
  return true;
}

/** A failed save stays on screen until a save succeeds: what is not saved is lost on reload. */
function setStorageWarning(text) {
  ui.storageBanner.hidden = !text;
  if (text) ui.storageBanner.replaceChildren(icon('alert', 16), h('span', { text: `${text} New messages are not saved until then.` }));
}

function iconButton(name, title, onClick, extra = '') {
  const b = h('button', { className: `icon-btn ${extra}`.trim(), title, attrs: { type: 'button', 'aria-label': title } });
  b.appendChild(icon(name, 16));
  if (onClick) b.addEventListener('click', onClick);
  return b;
}

function downloadJSON(name, data) {
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: 'application/json' });
  const url = URL.createObjectURL(blob);
  const a = h('a', { attrs: { href: url, download: name } });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

function fileName(title) {
  const slug = (title || 'chat').toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, '').slice(0, 40) || 'chat';
  return `xinfer-${slug}.json`;
}

function exportable(conv) {
  const strip = ({ pending, ...m }) => m; // eslint-disable-line no-unused-vars
  return { ...conv, messages: conv.messages.map(strip), exported: new Date().toISOString(), app: 'xinfer-ui' };
}

// --------------------------------------------------------------- server ---

function setOnline(online) {
  if (state.online === online) return;
  state.online = online;
  ui.statusDot.className = `status-dot ${online ? 'online' : 'offline'}`;
  ui.statusDot.title = online ? 'Connected' : 'Server unreachable';
  ui.banner.hidden = online;
  if (!online) {
    ui.banner.replaceChildren(icon('plug', 16), h('span', {
      text: 'Cannot reach the xInfer server. Retrying… Check that "xinfer --ui-server" is still running.',
    }));
    pollServer();
  }
}

/** The server answers but its engine may not take requests yet (loading the model) or any more. */
function setReady(health) {
  const ready = health.ready;
  state.serverStatus = health.status;
  if (health.status !== 'loading') releaseHeldReplies();
  ui.statusDot.classList.toggle('loading', !ready);
  ui.statusDot.title = ready ? 'Connected' : `Server ${health.status}`;
  if (ready) {
    ui.banner.hidden = true;
    return;
  }
  const text = health.status === 'loading'
    ? 'The server is loading the model: replies can start once it is ready.'
    : `The server cannot take requests now (${health.status})${health.error ? `: ${health.error}` : ''}. Retrying…`;
  ui.banner.replaceChildren(icon('plug', 16), h('span', { text }));
  ui.banner.hidden = false;
  pollServer(1000); // a model is ready the moment it has loaded: look often
}

let pollTimer = null;
/** Check the server again in `delay` ms (once: refreshModels asks again while it is not ready). */
function pollServer(delay = 3000) {
  if (pollTimer) return;
  pollTimer = setTimeout(() => { pollTimer = null; refreshModels(); }, delay);
}

const HEARTBEAT_MS = 12000;

/**
 * Whether the server is still there, while the page thinks it is fine (it polls by
 * itself otherwise): a server that was killed or stopped tells nobody.
 */
async function checkServer() {
  if (document.hidden || pollTimer || state.online !== true || state.serverStatus !== 'ok') return;
  try {
    setReady(await serverHealth());
  } catch (e) {
    if (e instanceof ServerDownError) setOnline(false);
  }
}

const heldReplies = new Set(); // resolve functions of the replies waiting for the model to load

/** Resolves once the server is not loading its model (at once if it is not); rejects when `signal` aborts. */
function modelLoaded(signal) {
  if (state.serverStatus !== 'loading') return Promise.resolve();
  return new Promise((resolve, reject) => {
    const release = () => { signal.removeEventListener('abort', abort); resolve(); };
    const abort = () => { heldReplies.delete(release); reject(new DOMException('Stopped', 'AbortError')); };
    heldReplies.add(release);
    signal.addEventListener('abort', abort, { once: true });
  });
}

function releaseHeldReplies() {
  for (const release of heldReplies) release();
  heldReplies.clear();
}

let configLoaded = false;
const KEY_CHANGED = 'The server no longer accepts this page\'s API key (it was restarted with another?): reload the page.';

/** Load config (once), the model list and the engine's health; returns true when the server is ready. */
async function refreshModels() {
  try {
    if (!configLoaded) {
      await loadConfig();
      configLoaded = true;
    }
    // Health first: a card listed once the server is ready is the loaded model's (one listed
    // while it loads has no context size or modalities yet, and a poll follows).
    const health = await serverHealth();
    const models = await listModels();
    state.models = models;
    const keep = state.model && models.find((m) => m.id === state.model.id);
    state.model = keep || models[0] || null;
    renderModel();
    setOnline(true);
    setReady(health);
    return health.ready;
  } catch (e) {
    if (e instanceof ServerDownError) {
      setOnline(false);
      pollServer();
    } else {
      setOnline(true);
      const notReady = e instanceof ApiError && e.status >= 500;
      ui.modelName.textContent = notReady ? 'Server starting…' : 'Model list unavailable';
      ui.modelName.title = e.message;
      if (notReady) pollServer(); // e.g. 503 while the model loads
      if (e instanceof ApiError && e.status === 401) toast(KEY_CHANGED, 'error');
    }
    return false;
  }
}

function renderModel() {
  const m = state.model;
  if (m && m.id.includes('/')) {
    // "org/name": the org part is hidden on narrow screens.
    const cut = m.id.lastIndexOf('/') + 1;
    ui.modelName.replaceChildren(h('span', { className: 'model-org', text: m.id.slice(0, cut) }), document.createTextNode(m.id.slice(cut)));
  } else {
    ui.modelName.textContent = m ? m.id : 'No model loaded';
  }
  ui.modelName.title = m ? m.id : '';
  if (m) ui.modelName.dataset.model = m.id;
  else delete ui.modelName.dataset.model;
  ui.modelCtx.textContent = m && m.maxModelLen ? `${formatContext(m.maxModelLen)} context` : '';
  ui.modelCtx.title = m && m.maxModelLen ? `Max context: ${formatInt(m.maxModelLen)} tokens` : '';
  ui.modelCtx.hidden = !(m && m.maxModelLen);
  ui.attach.hidden = !(m && m.images); // only a model that takes images gets an attach button
  if (state.models.length > 1) {
    ui.modelSelect.replaceChildren(...state.models.map((x) => {
      const o = h('option', { text: x.id });
      o.value = x.id;
      o.selected = m && x.id === m.id;
      return o;
    }));
    ui.modelSelect.hidden = false;
    ui.modelName.hidden = true;
  } else {
    ui.modelSelect.hidden = true;
    ui.modelName.hidden = false;
  }
  const emptyModel = $('#empty-model');
  if (emptyModel) emptyModel.textContent = m ? m.id : '';
}

// -------------------------------------------------------------- sidebar ---

function renderSidebar() {
  const items = state.convs.map((c) => {
    const title = h('span', { className: 'conv-title', text: c.title });
    const open = h('button', {
      className: 'conv-open',
      title: `${c.title}\n${relativeTime(c.updated)}`,
      attrs: { type: 'button' },
      on: { click: () => openConversation(c.id) },
    }, title);
    const actions = h('div', { className: 'conv-actions' },
      iconButton('edit', 'Rename', (e) => { e.stopPropagation(); startRename(c.id); }),
      iconButton('download', 'Export as JSON', (e) => { e.stopPropagation(); downloadJSON(fileName(c.title), exportable(c)); }),
      iconButton('trash', 'Delete', (e) => { e.stopPropagation(); askDelete(c.id, e.currentTarget); }, 'danger'));
    return h('div', {
      className: `conv-item${c.id === state.currentId ? ' active' : ''}${busy(c) ? ' streaming' : ''}`,
      dataset: { convId: c.id },
    }, open, actions);
  });
  if (!items.length) items.push(h('div', { className: 'conv-empty', text: 'No conversations yet' }));
  ui.convList.replaceChildren(...items);
}

/** Mark the conversations streaming in the sidebar, leaving the list as it is (a rename may be open). */
function markStreaming() {
  for (const item of ui.convList.querySelectorAll('.conv-item')) {
    item.classList.toggle('streaming', state.gens.has(item.dataset.convId));
  }
}

function startRename(id) {
  const conv = state.convs.find((c) => c.id === id);
  const item = ui.convList.querySelector(`[data-conv-id="${CSS.escape(id)}"]`);
  if (!conv || !item) return;
  const input = h('input', { className: 'conv-rename', attrs: { type: 'text', 'aria-label': 'Conversation name', maxlength: '200' } });
  input.value = conv.title;
  let done = false;
  const finish = (save, refocus = false) => {
    if (done) return;
    done = true;
    const v = input.value.trim();
    if (save && v) {
      conv.title = v;
      persist();
      if (conv.id === state.currentId) document.title = `${conv.title} · xInfer`;
    }
    renderSidebar();
    // From the keyboard, focus goes back to the conversation (it was on the input, now gone).
    if (refocus) ui.convList.querySelector(`[data-conv-id="${CSS.escape(id)}"] .conv-open`)?.focus();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter') { e.preventDefault(); finish(true, true); }
    else if (e.key === 'Escape') { e.preventDefault(); finish(false, true); }
  });
  input.addEventListener('blur', () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function askDelete(id, button) {
  if (button.classList.contains('confirm')) {
    deleteConversation(id);
    return;
  }
  button.classList.add('confirm');
  button.title = 'Click again to delete';
  button.replaceChildren(h('span', { text: 'Delete?' }));
  setTimeout(() => {
    button.classList.remove('confirm');
    button.title = 'Delete';
    button.replaceChildren(icon('trash', 16));
  }, 3000);
}

function deleteConversation(id) {
  const fromList = ui.convList.contains(document.activeElement);
  const gen = state.gens.get(id);
  if (gen) gen.controller.abort();
  state.convs = state.convs.filter((c) => c.id !== id);
  persist();
  if (state.currentId === id) {
    state.currentId = state.convs[0] ? state.convs[0].id : null;
    saveCurrentId(state.currentId);
  }
  renderAll();
  if (fromList) (ui.convList.querySelector('.conv-open') || $('#new-chat')).focus(); // the focused button is gone
}

function openConversation(id) {
  state.currentId = id;
  state.editingId = null;
  saveCurrentId(id);
  ui.app.classList.remove('sidebar-open');
  renderAll();
  scrollToBottom(true);
  ui.input.focus();
}

function newChat() {
  // Reuse an existing empty conversation instead of piling them up.
  const empty = state.convs.find((c) => c.messages.length === 0);
  if (empty) {
    openConversation(empty.id);
    return;
  }
  state.currentId = null;
  state.editingId = null;
  saveCurrentId(null);
  ui.app.classList.remove('sidebar-open');
  renderAll();
  ui.input.focus();
}

// ------------------------------------------------------------- messages ---

function isLast(conv, msg, role) {
  for (let i = conv.messages.length - 1; i >= 0; i--) {
    if (conv.messages[i].role === role) return conv.messages[i] === msg;
  }
  return false;
}

// The open conversation's message views, kept between redraws: a message is drawn again only
// when what its view shows changed (drawing them all again took a second at 500 turns).
let viewsOf = null; // the conversation they show
let views = new WeakMap(); // message -> {node, key}: see viewKey

function renderMessages() {
  const conv = current();
  const msgs = conv ? conv.messages : [];
  const active = document.activeElement;
  const focused = ui.messages.contains(active) || ui.empty.contains(active) ? active : null;
  if (conv !== viewsOf) {
    viewsOf = conv;
    views = new WeakMap();
  }
  ui.empty.hidden = msgs.length > 0;
  ui.messages.classList.toggle('busy', busy(conv)); // hides the edit buttons (style.css)
  const nodes = msgs.map((m) => viewOf(conv, m));
  const lastOmitted = msgs.findLastIndex((m) => m.omitted);
  if (lastOmitted !== -1) nodes.splice(lastOmitted + 1, 0, omittedNote());
  placeChildren(ui.messages, nodes);
  document.title = conv && conv.messages.length ? `${conv.title} · xInfer` : 'xInfer';
  updateJump();
  // Keyboard focus on a button the redraw took away (Regenerate, Retry, the edit box, a
  // suggestion) goes to the message box, as after Send: else it falls to the page's start.
  if (focused && (!focused.isConnected || !focused.getClientRects().length)) ui.input.focus();
}

/** Make `nodes` the children of `parent`, leaving in place those already there (each change costs a layout). */
function placeChildren(parent, nodes) {
  const keep = new Set(nodes);
  for (const child of [...parent.children]) if (!keep.has(child)) child.remove();
  let at = parent.firstElementChild;
  for (const node of nodes) {
    if (node === at) at = at.nextElementSibling;
    else parent.insertBefore(node, at);
  }
}

/**
 * What the view of `msg` shows (the message's fields and the state it depends on), to
 * compare with what it showed; null: draw it again anyway (an error's view depends on more).
 */
function viewKey(conv, msg) {
  if (msg.role === 'user') {
    return [msg.content, msg.images, msg.imagesRemoved, msg.unsent, msg.omitted, state.editingId === msg.id,
      isLast(conv, msg, 'user')];
  }
  if (msg.error) return null;
  const gen = state.gens.get(conv.id);
  return [msg.content, msg.reasoning, msg.pending, msg.stopped, msg.omitted, msg.stats, canRegenerate(conv, msg),
    !!(gen && gen.msg === msg && gen.waiting)];
}

const sameKey = (a, b) => !!a && !!b && a.length === b.length && a.every((x, i) => x === b[i]);

/** The view of `msg`: the one drawn before if it still shows the same, else drawn again. */
function viewOf(conv, msg) {
  const key = viewKey(conv, msg);
  const view = views.get(msg);
  if (view && sameKey(view.key, key)) return view.node;
  const node = messageView(conv, msg, view && view.node);
  views.set(msg, { node, key });
  return node;
}

/**
 * A message's view (a reply's `old` one is updated: its markdown is parsed again only if it
 * changed); one that cannot be drawn is said so, and does not stop the others (or the page).
 */
function messageView(conv, msg, old) {
  try {
    if (msg.role === 'user') return userView(conv, msg);
    if (!old || !old.classList.contains('assistant')) return assistantView(conv, msg);
    updateAssistant(old, conv, msg);
    return old;
  } catch (e) {
    console.error(e);
    return h('div', { className: 'msg broken', text: 'This message could not be shown.', dataset: { msgId: msg.id } });
  }
}

function omittedNote() {
  const max = state.model && state.model.maxModelLen;
  return h('div', { className: 'context-note', attrs: { role: 'note' } },
    h('span', { text: `The conversation outgrew the model's context${max ? ` (${formatInt(max)} tokens)` : ''}: ` +
      'the messages above are no longer sent with new ones.' }),
    h('button', { className: 'btn small', text: 'New chat', attrs: { type: 'button' }, on: { click: newChat } }));
}

function renderAll() {
  renderSidebar();
  renderMessages();
  renderComposer();
}

function userView(conv, msg) {
  const node = h('div', { className: 'msg user', dataset: { msgId: msg.id, role: 'user' } });
  if (state.editingId === msg.id) {
    const ta = h('textarea', { className: 'edit-box', attrs: { 'aria-label': 'Edit message', rows: '3', dir: 'auto' } });
    ta.value = msg.content;
    const cancel = h('button', { className: 'btn', text: 'Cancel', attrs: { type: 'button' }, on: { click: () => { state.editingId = null; renderMessages(); } } });
    const save = h('button', { className: 'btn primary', text: 'Send', attrs: { type: 'button' }, on: { click: () => submitEdit(conv, msg, ta.value) } });
    ta.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); submitEdit(conv, msg, ta.value); }
      else if (e.key === 'Escape') { e.preventDefault(); state.editingId = null; renderMessages(); }
    });
    node.append(h('div', { className: 'edit-wrap' }, ta, h('div', { className: 'edit-actions' }, cancel, save)));
    requestAnimationFrame(() => { autosize(ta, 400); ta.focus(); ta.setSelectionRange(ta.value.length, ta.value.length); });
    ta.addEventListener('input', () => autosize(ta, 400));
    return node;
  }
  const bubble = h('div', { className: 'bubble', text: msg.content, attrs: { dir: 'auto' } });
  node.classList.toggle('unsent', !!msg.unsent);
  node.classList.toggle('omitted', !!msg.omitted);
  const note = msg.unsent ? h('div', { className: 'unsent-note', text: 'Not sent again: too long for the model\'s context' }) : null;
  if (msg.images && msg.images.length) {
    const pictures = msg.images.map((url) => h('img', { attrs: { src: url, alt: 'attached image' } }));
    node.append(h('div', { className: 'msg-images' }, ...pictures));
  }
  if (msg.imagesRemoved) {
    const n = msg.imagesRemoved;
    node.append(h('div', { className: 'images-removed', text: `${n} image${n > 1 ? 's' : ''} removed to free browser storage` }));
  }
  // Any user message can be edited (not while a reply streams: style.css hides the button
  // then): the turns after it are replaced by the new reply.
  const actions = h('div', { className: 'msg-actions' },
    copyButton(() => msg.content),
    iconButton('edit', 'Edit message', () => { state.editingId = msg.id; renderMessages(); }, 'edit-btn'));
  actions.classList.toggle('always', isLast(conv, msg, 'user'));
  node.append(...[bubble, note, actions].filter(Boolean));
  return node;
}

function copyButton(getText) {
  const b = iconButton('copy', 'Copy', async () => {
    const ok = await copyText(getText());
    b.replaceChildren(icon(ok ? 'check' : 'alert', 16));
    setTimeout(() => b.replaceChildren(icon('copy', 16)), 1200);
  }, 'copy-btn');
  return b;
}

function assistantView(conv, msg) {
  const node = h('div', { className: 'msg assistant', dataset: { msgId: msg.id, role: 'assistant' } });
  const avatar = h('div', { className: 'avatar', attrs: { 'aria-hidden': 'true' }, text: 'x' });
  const summary = h('summary', {}, h('span', { className: 'reasoning-label', text: 'Reasoning' }));
  const reasoning = h('details', { className: 'reasoning' }, summary, h('div', { className: 'reasoning-content md', attrs: { dir: 'auto' } }));
  reasoning.hidden = true;
  const body = h('div', { className: 'msg-body' },
    reasoning,
    h('div', { className: 'msg-content md', attrs: { dir: 'auto' } }),
    h('p', { className: 'msg-empty', text: 'The model returned an empty reply.' }),
    h('div', { className: 'typing', attrs: { 'aria-label': 'Waiting for the reply' } }, h('span'), h('span'), h('span')),
    h('p', { className: 'msg-wait', text: 'Waiting for the server to finish loading the model: the message is sent then.' }),
    h('div', { className: 'msg-error', attrs: { role: 'alert' } }),
    h('div', { className: 'msg-footer' }, h('div', { className: 'stats', dataset: { testid: 'stats' } }), h('div', { className: 'msg-actions' })));
  node.append(avatar, body);
  updateAssistant(node, conv, msg);
  return node;
}

const rendered = new WeakMap(); // .msg-content or .reasoning-content element -> the markdown it shows

function renderMarkdownOnce(src, container) {
  if (rendered.get(container) === src) return;
  rendered.set(container, src);
  renderMarkdown(src, container);
}

/** Update an assistant message's node from `msg` (called for every streamed frame). */
function updateAssistant(node, conv, msg) {
  const streaming = !!msg.pending;
  const parts = splitThink(msg.content);
  const reasoningText = [msg.reasoning || '', parts.reasoning].filter((s) => s.trim()).join('\n\n');
  const thinking = streaming && (parts.thinking || (!!msg.reasoning && !parts.answer));
  node.classList.toggle('streaming', streaming);
  node.classList.toggle('omitted', !!msg.omitted);

  const details = node.querySelector('.reasoning');
  details.hidden = !reasoningText.trim();
  if (!details.hidden) {
    const label = details.querySelector('.reasoning-label');
    const secs = msg.stats && msg.stats.thinkMs ? ` for ${formatSeconds(msg.stats.thinkMs)}` : '';
    label.textContent = thinking ? 'Thinking…' : `Reasoning${secs ? ` (thought${secs})` : ''}`;
    details.classList.toggle('thinking', thinking);
    renderMarkdownOnce(reasoningText.trim(), details.querySelector('.reasoning-content'));
  }

  const content = node.querySelector('.msg-content');
  renderMarkdownOnce(parts.answer, content);
  content.hidden = !parts.answer;
  node.querySelector('.msg-empty').hidden = streaming || !!parts.answer || !!reasoningText || !!msg.error || !!msg.stopped;

  const waiting = streaming && !parts.answer && !reasoningText;
  node.querySelector('.typing').hidden = !waiting;
  const gen = state.gens.get(conv.id);
  node.querySelector('.msg-wait').hidden = !(streaming && gen && gen.msg === msg && gen.waiting);

  const errBox = node.querySelector('.msg-error');
  errBox.replaceChildren(...(msg.error ? errorView(msg) : []));
  errBox.hidden = !msg.error;

  renderStats(node.querySelector('.stats'), msg);

  const actions = node.querySelector('.msg-actions');
  const list = [];
  if (!streaming) {
    if (msg.content) list.push(copyButton(() => splitThink(msg.content).answer || msg.content));
    if (canRegenerate(conv, msg)) list.push(iconButton('regen', 'Regenerate reply', () => regenerate(conv), 'regen-btn'));
  }
  actions.replaceChildren(...list);
  actions.classList.toggle('always', list.some((b) => b.classList.contains('regen-btn')));
}

/** Whether `msg` is the conversation's last reply, done (a failed one without text has its own buttons in the error box). */
function canRegenerate(conv, msg) {
  return isLast(conv, msg, 'assistant') && conv.messages[conv.messages.length - 1] === msg && !busy(conv) &&
    !(msg.error && !msg.content);
}

function errorView(msg) {
  const e = msg.error;
  const retry = h('button', { className: 'btn', text: 'Retry', attrs: { type: 'button' }, on: { click: () => regenerate(current()) } });
  const conv = current();
  const canRetry = !busy(conv) && conv && conv.messages[conv.messages.length - 1] === msg;
  if (e.kind === 'down') {
    return [h('div', { className: 'err-title' }, icon('plug', 16), h('span', { text: 'Cannot reach the xInfer server' })),
      h('p', { text: 'The request could not be sent or the connection was lost. Check that the server is running, then retry.' }),
      canRetry ? retry : null].filter(Boolean);
  }
  if (e.kind === 'overflow' && (e.param === 'max_tokens' || /max_tokens/.test(e.message)) && state.settings.maxTokens) {
    const max = state.model && state.model.maxModelLen;
    const clear = h('button', {
      className: 'btn primary', text: 'Clear "Max tokens" and retry', attrs: { type: 'button' },
      on: { click: () => { state.settings.maxTokens = null; persistSettings(); regenerate(current()); } },
    });
    return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: '"Max tokens" does not fit in the context' })),
      h('p', { text: `The prompt and the reply must fit in the model's context window${max ? ` of ${formatInt(max)} tokens` : ''}; "Max tokens" is ${formatInt(state.settings.maxTokens)}. Lower it in the settings, or clear it to use the rest of the context.` }),
      h('p', { className: 'err-detail', text: e.message }),
      canRetry ? h('div', { className: 'err-actions' }, clear) : null].filter(Boolean);
  }
  if (e.kind === 'overflow') {
    const size = state.model && state.model.maxModelLen ? ` of ${formatInt(state.model.maxModelLen)} tokens` : '';
    const newBtn = h('button', { className: 'btn', text: 'New chat', attrs: { type: 'button' }, on: { click: newChat } });
    if (conv && sentTurns(conv, msg).length <= 1) {
      // Older turns are left out as the conversation grows (leaveOutOldest): this message alone does not fit.
      const sys = (state.settings.systemPrompt || '').trim() ? ' with the system prompt' : '';
      return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: 'This message is too long for this model' })),
        h('p', { text: `It does not fit in the model's context window${size}${sys}. Edit it to make it shorter, or send another: this one is then left out.` }),
        h('p', { className: 'err-detail', text: e.message })];
    }
    const trim = h('button', {
      className: 'btn primary', text: 'Continue without the earliest messages', attrs: { type: 'button' },
      on: { click: () => { if (leaveOutOldest(conv, msg, e)) regenerate(conv); } },
    });
    return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: 'The conversation is too long for this model' })),
      h('p', { text: `It does not fit in the model's context window${size}. Go on without its earliest messages, or start a new chat.` }),
      h('p', { className: 'err-detail', text: e.message }),
      h('div', { className: 'err-actions' }, canRetry ? trim : null, newBtn)];
  }
  if (e.kind === 'auth') {
    const reload = h('button', { className: 'btn primary', text: 'Reload the page', attrs: { type: 'button' }, on: { click: () => location.reload() } });
    return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: 'The server\'s API key changed' })),
      h('p', { text: KEY_CHANGED }),
      h('p', { className: 'err-detail', text: e.message }),
      h('div', { className: 'err-actions' }, reload)];
  }
  if (e.kind === 'images') {
    const textOnly = /text only|cannot read images|does not (take|accept|support) images/i.test(e.message);
    const drop = h('button', {
      className: 'btn primary', text: 'Remove the images and retry', attrs: { type: 'button' },
      on: { click: () => dropImagesAndRetry(conv) },
    });
    return [h('div', { className: 'err-title' }, icon('image', 16), h('span', {
      text: textOnly ? `${msg.model || 'This model'} takes text only: it cannot read images` : 'The server refused an image',
    })),
    h('p', { text: 'The images stay in this conversation and are sent with every request: remove them to go on with text.' }),
    h('p', { className: 'err-detail', text: e.message }),
    canRetry ? h('div', { className: 'err-actions' }, drop) : null].filter(Boolean);
  }
  if (e.kind === 'stream') {
    return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: 'The reply was interrupted' })),
      h('p', { className: 'err-detail', text: e.message }), canRetry ? retry : null].filter(Boolean);
  }
  return [h('div', { className: 'err-title' }, icon('alert', 16), h('span', { text: `The server returned an error${e.status ? ` (${e.status})` : ''}` })),
    h('p', { className: 'err-detail', text: e.message }), canRetry ? retry : null].filter(Boolean);
}

function renderStats(box, msg) {
  const s = msg.stats || {};
  const items = [];
  const stat = (key, text, title) => items.push(h('span', { className: `stat stat-${key}`, text, title, dataset: { stat: key } }));
  const approx = s.approx ? '~' : '';
  const has = Number.isFinite;
  if (has(s.tps)) stat('tps', `${approx}${s.tps.toFixed(1)} tok/s`, 'Generation speed (tokens per second after the first token)');
  if (has(s.ttftMs)) stat('ttft', `TTFT ${formatSeconds(s.ttftMs)}`, 'Time to first token');
  if (has(s.promptTokens)) {
    stat('in', `${formatInt(s.promptTokens)} in`, 'Prompt tokens');
    if (has(s.cachedTokens)) stat('cached', `${formatInt(s.cachedTokens)} cached`, 'Prompt tokens served from the prefix cache');
  }
  if (has(s.completionTokens)) stat('out', `${approx}${formatInt(s.completionTokens)} out`, 'Completion tokens');
  if (msg.stopped) stat('stopped', 'stopped', 'Generation was stopped');
  else if (s.finishReason === 'length') stat('length', 'max tokens reached', 'The reply hit the max-tokens limit');
  box.replaceChildren(...items);
  box.hidden = !items.length;
}

// -------------------------------------------------------------- scrolling ---

let stick = true;

function nearBottom() {
  const s = ui.scroller;
  return s.scrollHeight - s.scrollTop - s.clientHeight < 80;
}

function scrollToBottom(force = false) {
  if (force) stick = true;
  if (stick) ui.scroller.scrollTop = ui.scroller.scrollHeight;
  updateJump();
}

function updateJump() {
  ui.jump.hidden = nearBottom();
}

// ------------------------------------------------------------ generation ---

/** A message's content as the API takes it: a string, or with images, OpenAI's content parts. */
function apiContent(text, images) {
  if (!images || !images.length) return text;
  const parts = text.trim() ? [{ type: 'text', text }] : [];
  return parts.concat(images.map((url) => ({ type: 'image_url', image_url: { url } })));
}

function asParts(content) {
  return typeof content === 'string' ? [{ type: 'text', text: content }] : content;
}

function historyFor(conv, upTo) {
  const out = [];
  const sys = (state.settings.systemPrompt || '').trim();
  if (sys) out.push({ role: 'system', content: sys });
  for (const m of conv.messages) {
    if (m === upTo) break;
    if (m.unsent || m.omitted) continue;
    const text = m.role === 'assistant' ? splitThink(m.content).answer : m.content;
    const images = m.role === 'user' ? m.images : null;
    if (!text.trim() && !(images && images.length)) continue; // failed or empty replies are not sent back
    const content = apiContent(text, images);
    const prev = out[out.length - 1];
    // Keep roles alternating (chat templates may require it): merge neighbours.
    if (prev && prev.role === m.role) {
      if (typeof prev.content === 'string' && typeof content === 'string') prev.content += `\n\n${content}`;
      else prev.content = asParts(prev.content).concat(asParts(content));
    } else out.push({ role: m.role, content });
  }
  return out;
}

function payloadFor(conv, msg) {
  const s = state.settings;
  const p = { messages: historyFor(conv, msg) };
  if (state.model) p.model = state.model.id;
  if (Number.isFinite(s.temperature)) p.temperature = s.temperature;
  if (Number.isFinite(s.topP)) p.top_p = s.topP;
  if (maxTokensOf(s.maxTokens)) p.max_tokens = s.maxTokens;
  return p;
}

/**
 * Draw `gen`'s reply on a coming frame. Drawing a reply costs more the longer it is (its
 * markdown is parsed whole): the draws are spaced so that they take at most a fifth of the
 * time, rather than every frame, which made long replies stream slower and slower.
 */
function scheduleUpdate(conv, gen) {
  if (gen.frame || gen.timer) return;
  const draw = () => {
    gen.timer = 0;
    gen.frame = requestAnimationFrame(() => {
      gen.frame = 0;
      if (conv.id !== state.currentId) return;
      const start = performance.now();
      const wasStuck = nearBottom() || stick;
      const node = ui.messages.querySelector(`[data-msg-id="${CSS.escape(gen.msg.id)}"]`);
      if (node) updateAssistant(node, conv, gen.msg);
      if (wasStuck) scrollToBottom();
      gen.drawn = performance.now();
      gen.drawMs = gen.drawn - start;
    });
  };
  const wait = gen.drawn + 4 * gen.drawMs - performance.now();
  if (wait > 0) gen.timer = setTimeout(draw, wait);
  else draw();
}

function cancelUpdate(gen) {
  if (gen.timer) clearTimeout(gen.timer);
  if (gen.frame) cancelAnimationFrame(gen.frame);
  gen.timer = gen.frame = 0;
}

/** Whether the error is a prompt longer than the context (not the reply's "Max tokens" that does not fit). */
function promptOverflow(e) {
  return e instanceof ApiError && e.contextOverflow && e.param !== 'max_tokens' && !/max_tokens/.test(e.message);
}

/** The prompt's and the context's sizes in tokens, as the server's error gives them (null if it does not). */
function overflowSizes(message) {
  const prompt = /prompt (?:has|is too long:?) (\d+) tokens|(\d+) (?:tokens )?in the messages/i.exec(message);
  const context = /context (?:is|length is|window is) (\d+) tokens/i.exec(message);
  if (!prompt || !context) return null;
  return { prompt: Number(prompt[1] || prompt[2]), context: Number(context[1]) };
}

/** The turns (a user message and the replies after it) of `conv` that go with a request for `msg`. */
function sentTurns(conv, msg) {
  const turns = [];
  for (const m of conv.messages) {
    if (m === msg) break;
    if (m.omitted || m.unsent) continue;
    if (m.role === 'user' || !turns.length) turns.push([m]);
    else turns[turns.length - 1].push(m);
  }
  return turns;
}

const sentLength = (m) => (m.role === 'assistant' ? splitThink(m.content).answer : m.content).length;

/**
 * Leave the oldest turns of `conv` out of its requests, enough for the prompt to fit the
 * context with room for a reply (by the server's count, shared out by length); false when
 * only the newest message is left: then it alone is too long.
 */
function leaveOutOldest(conv, msg, error) {
  const turns = sentTurns(conv, msg);
  const older = turns.slice(0, -1);
  if (!older.length) return false;
  const sizes = overflowSizes(error.message);
  let drop = Math.ceil(older.length / 2);
  if (sizes) {
    const chars = turns.flat().reduce((n, m) => n + sentLength(m), (state.settings.systemPrompt || '').length);
    const perChar = sizes.prompt / Math.max(chars, 1);
    const reply = Math.min(sizes.context / 2, state.settings.maxTokens || Math.min(sizes.context / 4, 1024));
    let excess = sizes.prompt - sizes.context + reply;
    drop = 0;
    while (drop < older.length && excess > 0) {
      excess -= older[drop].reduce((n, m) => n + sentLength(m), 0) * perChar;
      drop += 1;
    }
    drop = Math.max(drop, 1);
  }
  for (const turn of older.slice(0, drop)) for (const m of turn) m.omitted = true;
  return true;
}

/**
 * The chunks of the reply to `gen.msg`. A request that finds the model still loading waits
 * for it and is sent again; one whose history outgrew the context is sent again without
 * its oldest turns.
 */
async function* replyChunks(conv, gen) {
  const { msg, controller } = gen;
  for (;;) {
    if (state.serverStatus === 'loading') {
      gen.waiting = true;
      scheduleUpdate(conv, gen);
      await modelLoaded(controller.signal);
      gen.waiting = false;
      scheduleUpdate(conv, gen);
    }
    gen.t0 = performance.now();
    try {
      yield* streamChat(payloadFor(conv, msg), controller.signal);
      return;
    } catch (e) {
      const nothingYet = !msg.content && !msg.reasoning;
      if (nothingYet && e instanceof ApiError && e.modelLoading) {
        setReady({ ready: false, status: 'loading', error: null });
      } else if (nothingYet && promptOverflow(e) && leaveOutOldest(conv, msg, e)) {
        persist();
        if (conv.id === state.currentId) renderMessages();
      } else {
        throw e;
      }
    }
  }
}

let leaving = false; // the page is being unloaded: a cut stream is not an error

async function generate(conv) {
  if (busy(conv)) return;
  const msg = { id: uid(), role: 'assistant', content: '', reasoning: '', stats: {}, pending: true };
  if (state.model) msg.model = state.model.id;
  conv.messages.push(msg);
  conv.updated = Date.now();
  const controller = new AbortController();
  const gen = { msg, controller, frame: 0, timer: 0, drawn: 0, drawMs: 0, waiting: false, t0: performance.now() };
  state.gens.set(conv.id, gen);
  state.editingId = null;
  // Move the conversation to the top of the list.
  state.convs = [conv, ...state.convs.filter((c) => c !== conv)];
  persist();

  let tFirst = null;
  let tAnswer = null;
  let pieces = 0;
  let usage = null;
  try {
    // Drawn in the try: a page that fails to draw still ends the reply (it would stay busy, unstoppable).
    renderAll();
    scrollToBottom(true);
    if (!state.model) await refreshModels();
    if (state.model && !msg.model) msg.model = state.model.id;
    let answered = false;
    for await (const chunk of replyChunks(conv, gen)) {
      if (!answered) { answered = true; setOnline(true); }
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const r = delta.reasoning_content ?? delta.reasoning;
      const c = delta.content;
      if (r || c) {
        const now = performance.now();
        if (tFirst === null) tFirst = now;
        pieces += 1;
        if (r) msg.reasoning += r;
        if (c) {
          msg.content += c;
          if (tAnswer === null && splitThink(msg.content).answer) tAnswer = now;
        }
        // Live speed and count while streaming (approximate: one chunk ~ one token).
        msg.stats = { ...msg.stats, ttftMs: tFirst - gen.t0, completionTokens: pieces, approx: true };
        if (pieces > 1 && now - tFirst > 250) msg.stats.tps = (pieces - 1) / ((now - tFirst) / 1000);
      }
      if (choice.finish_reason) msg.stats.finishReason = choice.finish_reason;
      persist({ soon: true });
      scheduleUpdate(conv, gen);
    }
    setOnline(true);
  } catch (e) {
    if ((e && e.name === 'AbortError') || leaving) {
      msg.stopped = true; // by Stop, or by leaving the page (which cuts the stream)
    } else if (e instanceof StreamCutError) {
      // A reply that gave its finish_reason is whole even if the [DONE] after it was lost.
      if (!msg.stats.finishReason) msg.error = { kind: 'stream', message: e.message };
      refreshModels(); // is the server still there?
    } else if (e instanceof ServerDownError) {
      msg.error = { kind: 'down', message: e.message };
      setOnline(false);
    } else if (e instanceof ApiError) {
      const kind = e.status === 401 ? 'auth' : e.contextOverflow ? 'overflow' : e.imageRefused ? 'images' : 'api';
      msg.error = { kind, message: e.message, status: e.status || null, param: e.param || null };
      // A 5xx may come from a server shutting down or broken: see what it says of itself.
      if (e.status >= 500) refreshModels();
      else setOnline(true);
    } else {
      msg.error = { kind: 'api', message: String((e && e.message) || e) };
      console.error(e);
    }
  } finally {
    const { t0 } = gen;
    const tEnd = performance.now();
    const stats = { finishReason: msg.stats.finishReason };
    if (tFirst !== null) stats.ttftMs = tFirst - t0;
    if (tAnswer !== null && (msg.reasoning || splitThink(msg.content).reasoning)) stats.thinkMs = tAnswer - tFirst;
    let out = pieces;
    if (usage) {
      if (Number.isFinite(usage.prompt_tokens)) stats.promptTokens = usage.prompt_tokens;
      if (Number.isFinite(usage.completion_tokens)) out = usage.completion_tokens;
      const details = usage.prompt_tokens_details;
      if (details && Number.isFinite(details.cached_tokens)) stats.cachedTokens = details.cached_tokens;
    } else {
      stats.approx = true;
    }
    if (tFirst !== null) {
      stats.completionTokens = out;
      const decodeMs = tEnd - tFirst;
      if (out > 1 && decodeMs > 0) stats.tps = (out - 1) / (decodeMs / 1000);
      else if (out > 0) stats.tps = out / ((tEnd - t0) / 1000);
    } else if (usage) {
      stats.completionTokens = out;
    }
    stats.durationMs = tEnd - t0;
    msg.stats = stats;
    delete msg.pending;
    if (state.gens.get(conv.id) === gen) state.gens.delete(conv.id);
    conv.updated = Date.now();
    persist();
    cancelUpdate(gen);
    markStreaming();
    renderComposer();
    if (conv.id === state.currentId) {
      const wasStuck = nearBottom() || stick;
      renderMessages();
      if (wasStuck) scrollToBottom();
    }
  }
}

function send(text) {
  if (busy(current())) return;
  const content = text.trim();
  const images = state.attachments.slice();
  if (!content && !images.length) return;
  let conv = current();
  if (!conv) {
    conv = newConversation();
    state.convs.unshift(conv);
    state.currentId = conv.id;
    saveCurrentId(conv.id);
  }
  // A failed reply with no text is replaced by the next one.
  const last = conv.messages[conv.messages.length - 1];
  if (last && last.role === 'assistant' && last.error && !last.content) {
    const alone = sentTurns(conv, last).length <= 1;
    conv.messages.pop();
    // A message the context could not take by itself stays in view but is not sent again
    // (it would make every later request fail the same way).
    const refused = conv.messages[conv.messages.length - 1];
    if (last.error.kind === 'overflow' && last.error.param !== 'max_tokens' && alone && refused && refused.role === 'user') {
      refused.unsent = true;
    }
  }
  conv.messages.push(images.length ? { id: uid(), role: 'user', content, images } : { id: uid(), role: 'user', content });
  if (conv.title === 'New chat' || conv.messages.filter((m) => m.role === 'user').length === 1) conv.title = titleFrom(content || 'Image');
  state.attachments = [];
  renderAttachments();
  ui.input.value = '';
  autosize(ui.input);
  generate(conv);
}

function regenerate(conv) {
  if (!conv || busy(conv)) return;
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role === 'assistant') conv.messages.pop();
  if (!conv.messages.length) return;
  generate(conv);
}

function submitEdit(conv, msg, text) {
  const content = text.trim();
  if (!content || busy(conv)) return;
  const i = conv.messages.indexOf(msg);
  if (i === -1) return;
  msg.content = content;
  delete msg.unsent;
  delete msg.omitted;
  conv.messages.splice(i + 1);
  if (i === 0) conv.title = titleFrom(content);
  state.editingId = null;
  generate(conv);
}

/** Take the images out of `conv` (a model refused them) and ask again with its text. */
function dropImagesAndRetry(conv) {
  if (!conv || busy(conv)) return;
  for (const m of conv.messages) delete m.images;
  conv.messages = conv.messages.filter((m) => m.role !== 'user' || m.content.trim());
  if (conv.messages.some((m) => m.role === 'user')) regenerate(conv);
  else { conv.messages = []; persist(); renderAll(); }
}

function stop() {
  const gen = state.gens.get(state.currentId);
  if (gen) gen.controller.abort();
}

// -------------------------------------------------------------- composer ---

function autosize(ta, max = 220) {
  ta.style.height = 'auto';
  ta.style.height = `${Math.min(ta.scrollHeight, max)}px`;
}

// ------------------------------------------------------------ attachments ---

/** Images picked for the next message, as data: URLs (the API takes them in image_url parts). */
function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith('image/')) { toast(`${file.name} is not an image`); continue; }
    const reader = new FileReader();
    reader.onload = () => { state.attachments.push(reader.result); renderAttachments(); renderComposer(); };
    reader.onerror = () => toast(`Could not read ${file.name}`);
    reader.readAsDataURL(file);
  }
}

/** Pasted or dropped files: attached when they are images and the model reads images. */
function takeImages(files) {
  if (state.model && !state.model.images) toast(`${state.model.id} takes text only: it cannot read images`, 'error');
  else attachFiles(files);
}

function renderAttachments() {
  ui.attachments.replaceChildren(...state.attachments.map((url, i) => h('div', { className: 'attachment' },
    h('img', { attrs: { src: url, alt: 'attached image' } }),
    h('button', { className: 'remove', text: '×', attrs: { type: 'button', title: 'Remove', 'aria-label': 'Remove image' },
      on: { click: () => { state.attachments.splice(i, 1); renderAttachments(); renderComposer(); } } }))));
  ui.attachments.hidden = !state.attachments.length;
}

function renderComposer() {
  const streaming = busy(current());
  // Send and Stop take turns: keyboard focus on the one hidden goes to the message box.
  const focused = document.activeElement;
  ui.send.hidden = streaming;
  ui.stop.hidden = !streaming;
  if ((focused === ui.send && streaming) || (focused === ui.stop && !streaming)) ui.input.focus();
  ui.send.disabled = !ui.input.value.trim() && !state.attachments.length;
  const sys = (state.settings.systemPrompt || '').trim();
  ui.sysIndicator.textContent = sys ? `System prompt: ${clip(sys, 60)}` : '';
  ui.sysIndicator.hidden = !sys;
  $('#open-settings').classList.toggle('has-dot', !!sys);
}

// -------------------------------------------------------------- settings ---

function persistSettings() {
  try {
    saveSettings(state.settings);
  } catch (e) {
    toast(e.message, 'error');
  }
  window.dispatchEvent(new Event('xinfer-theme'));
  renderComposer();
}

function bindSettings() {
  const f = {
    system: $('#set-system'),
    maxTokens: $('#set-max-tokens'),
    theme: $('#set-theme'),
  };
  // Temperature and top-p: a range, a number box and an Auto toggle each. Auto (null) is not
  // sent: the server's default applies. It shows as an empty box, a dimmed range and the toggle pressed.
  const sampling = {
    temperature: { range: $('#set-temperature'), box: $('#set-temperature-num'), auto: $('#set-temperature-auto') },
    topP: { range: $('#set-top-p'), box: $('#set-top-p-num'), auto: $('#set-top-p-auto') },
  };
  const AUTO_AT = '1'; // where a range rests while Auto: the model's distribution as it is
  const showSampling = (key, withBox) => {
    const { range, box, auto } = sampling[key];
    const x = state.settings[key];
    const isAuto = !Number.isFinite(x);
    if (withBox) box.value = isAuto ? '' : String(x);
    range.value = isAuto ? AUTO_AT : String(x);
    range.classList.toggle('auto', isAuto);
    if (isAuto) range.setAttribute('aria-valuetext', 'Auto (server default)');
    else range.removeAttribute('aria-valuetext');
    auto.setAttribute('aria-pressed', String(isAuto));
  };
  const fill = () => {
    const s = state.settings;
    f.system.value = s.systemPrompt || '';
    for (const key of Object.keys(sampling)) showSampling(key, true);
    f.maxTokens.value = s.maxTokens ? String(s.maxTokens) : '';
    f.maxTokens.setCustomValidity('');
    f.theme.value = s.theme || 'system';
    f.maxTokens.max = state.model && state.model.maxModelLen ? String(state.model.maxModelLen) : '';
    const ctx = $('#max-tokens-hint');
    ctx.textContent = state.model && state.model.maxModelLen
      ? `Empty: up to the rest of the context (${formatInt(state.model.maxModelLen)} tokens in all).`
      : 'Empty: the server decides.';
  };
  const save = persistSettings;
  f.system.addEventListener('input', () => { state.settings.systemPrompt = f.system.value; save(); });
  for (const key of Object.keys(sampling)) {
    const { range, box, auto } = sampling[key];
    const set = (x, withBox) => { state.settings[key] = x; showSampling(key, withBox); save(); };
    range.addEventListener('input', () => set(samplingOf(key, parseFloat(range.value)), true));
    // An empty box is Auto; a number out of range is saved at its nearest end (the API takes
    // top_p in (0, 1]), and the box shows what is saved when left.
    box.addEventListener('input', () => {
      const x = samplingOf(key, parseFloat(box.value));
      if (x !== null || (!box.value && !box.validity.badInput)) set(x, false);
    });
    box.addEventListener('change', () => showSampling(key, true));
    // Pressed: back to Auto; unpressed: the value the range shows, to change from there.
    auto.addEventListener('click', () => set(Number.isFinite(state.settings[key]) ? null : samplingOf(key, parseFloat(range.value)), true));
  }
  // A whole number of tokens, or empty for Auto; anything else is not saved, and the box
  // goes back to what is saved when left.
  f.maxTokens.addEventListener('input', () => {
    const box = f.maxTokens;
    const empty = !box.value && !box.validity.badInput;
    const x = maxTokensOf(Number(box.value));
    box.setCustomValidity(empty || x ? '' : 'A whole number of tokens (1 or more), or empty for Auto');
    if (!empty && !x) return;
    state.settings.maxTokens = x;
    save();
  });
  f.maxTokens.addEventListener('change', () => {
    f.maxTokens.value = state.settings.maxTokens ? String(state.settings.maxTokens) : '';
    f.maxTokens.setCustomValidity('');
  });
  f.theme.addEventListener('change', () => { state.settings.theme = f.theme.value; save(); });
  $('#settings-reset').addEventListener('click', () => {
    state.settings = { ...DEFAULT_SETTINGS };
    fill();
    save();
  });
  $('#open-settings').addEventListener('click', () => { fill(); ui.settings.showModal(); });
  $('#settings-close').addEventListener('click', () => ui.settings.close());
  ui.settings.addEventListener('click', (e) => { if (e.target === ui.settings) ui.settings.close(); });
}

// ------------------------------------------------------------------ init ---

function bind() {
  for (const el of document.querySelectorAll('[data-icon]')) el.prepend(icon(el.dataset.icon, Number(el.dataset.iconSize) || 18));

  ui.composer.addEventListener('submit', (e) => { e.preventDefault(); send(ui.input.value); });
  ui.input.addEventListener('input', () => { autosize(ui.input); renderComposer(); });
  ui.attach.addEventListener('click', () => ui.attachInput.click());
  ui.attachInput.addEventListener('change', () => { attachFiles([...ui.attachInput.files]); ui.attachInput.value = ''; });
  // An input method's Enter picks a candidate, it does not send (Safari reports that
  // Enter after compositionend, with keyCode 229).
  let composing = false;
  ui.input.addEventListener('compositionstart', () => { composing = true; });
  ui.input.addEventListener('compositionend', () => { setTimeout(() => { composing = false; }, 0); });
  ui.input.addEventListener('paste', (e) => {
    const data = e.clipboardData;
    // Text is pasted as text (office apps put a picture of it beside it): only a lone image is attached.
    if (!data || data.getData('text/plain') || ![...data.files].some((f) => f.type.startsWith('image/'))) return;
    e.preventDefault();
    takeImages([...data.files]);
  });
  // A file dropped on the page is attached; the browser would open it in the page's place.
  window.addEventListener('dragover', (e) => { if (e.dataTransfer && e.dataTransfer.types.includes('Files')) e.preventDefault(); });
  window.addEventListener('drop', (e) => {
    const files = [...(e.dataTransfer ? e.dataTransfer.files : [])];
    if (!files.length) return;
    e.preventDefault();
    takeImages(files);
  });
  ui.input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && !composing && e.keyCode !== 229) {
      e.preventDefault();
      send(ui.input.value);
    }
  });
  // Escape stops the reply wherever the focus is, unless something else took the key
  // (a rename box, the edit box) or a dialog is open (Escape closes it).
  document.addEventListener('keydown', (e) => {
    if (e.key !== 'Escape' || e.defaultPrevented || e.isComposing || ui.settings.open || !busy(current())) return;
    e.preventDefault();
    stop();
  });
  ui.stop.addEventListener('click', stop);
  $('#new-chat').addEventListener('click', newChat);
  $('#open-sidebar').addEventListener('click', () => ui.app.classList.add('sidebar-open'));
  $('#close-sidebar').addEventListener('click', () => ui.app.classList.remove('sidebar-open'));
  $('#backdrop').addEventListener('click', () => ui.app.classList.remove('sidebar-open'));
  ui.sidebar.addEventListener('keydown', (e) => {
    if (e.key !== 'Escape' || !ui.app.classList.contains('sidebar-open')) return;
    e.preventDefault(); // the key closes the sidebar, it does not also stop a reply
    ui.app.classList.remove('sidebar-open');
  });
  $('#export-current').addEventListener('click', () => {
    const conv = current();
    if (!conv || !conv.messages.length) { toast('Nothing to export yet'); return; }
    downloadJSON(fileName(conv.title), exportable(conv));
  });
  $('#export-all').addEventListener('click', () => {
    if (!state.convs.length) { toast('Nothing to export yet'); return; }
    downloadJSON('xinfer-conversations.json', { app: 'xinfer-ui', exported: new Date().toISOString(), conversations: state.convs.map(exportable) });
  });
  $('#import').addEventListener('click', () => $('#import-file').click());
  $('#import-file').addEventListener('change', async (e) => {
    const file = e.target.files && e.target.files[0];
    e.target.value = '';
    if (!file) return;
    try {
      const list = parseImport(await file.text(), state.convs.map((c) => c.id));
      state.convs = [...list, ...state.convs].sort((a, b) => b.updated - a.updated);
      persist();
      openConversation(list[0].id);
      toast(`Imported ${list.length} conversation${list.length > 1 ? 's' : ''}`);
    } catch (err) {
      toast(`Import failed: ${err.message}`, 'error');
    }
  });
  ui.modelSelect.addEventListener('change', () => {
    state.model = state.models.find((m) => m.id === ui.modelSelect.value) || state.model;
    renderModel();
  });
  ui.scroller.addEventListener('scroll', () => {
    stick = nearBottom();
    updateJump();
  }, { passive: true });
  ui.jump.addEventListener('click', () => { scrollToBottom(true); });
  for (const b of document.querySelectorAll('.suggestion')) {
    b.addEventListener('click', () => send(b.dataset.prompt || b.textContent));
  }
  // A reload or a closed tab keeps the text streamed so far (saves are otherwise batched).
  window.addEventListener('pagehide', () => { leaving = true; if (state.gens.size) persist(); });
  window.addEventListener('pageshow', () => { leaving = false; });
  window.addEventListener('storage', (e) => {
    if (isSettingsKey(e.key)) { state.settings = loadSettings(); renderComposer(); return; }
    if (!isConversationsKey(e.key)) return;
    // Another tab changed the conversations: take its list, keeping the ones streaming
    // here as they are (the next save writes both, where ignoring it lost the other's).
    const streaming = state.convs.filter(busy);
    const stored = loadConversations().filter((c) => !busy(c));
    state.convs = [...streaming, ...stored].sort((a, b) => b.updated - a.updated);
    if (!current()) state.currentId = state.convs[0] ? state.convs[0].id : null;
    renderAll();
  });
  bindSettings();
}

function init() {
  bind();
  if (state.currentId && !current()) state.currentId = null;
  try {
    renderAll();
    scrollToBottom(true);
  } catch (e) {
    console.error(e); // what was stored cannot be drawn: the page still starts, to talk to the server
  }
  refreshModels();
  setInterval(checkServer, HEARTBEAT_MS);
  document.addEventListener('visibilitychange', checkServer);
  ui.input.focus();
  document.documentElement.dataset.ready = 'true';
}

init();
