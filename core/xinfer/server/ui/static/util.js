// Small helpers shared by the page's modules.

/** Copy text to the clipboard; works on plain-http pages too. Resolves to true on success. */
export async function copyText(text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch {
    // fall through to the legacy path
  }
  const ta = document.createElement('textarea');
  ta.value = text;
  ta.setAttribute('readonly', '');
  ta.style.position = 'fixed';
  ta.style.top = '-1000px';
  document.body.appendChild(ta);
  ta.select();
  let ok = false;
  try {
    ok = document.execCommand('copy');
  } catch {
    ok = false;
  }
  ta.remove();
  return ok;
}

/** Create an element with optional class, text and attributes (never HTML). */
export function h(tag, opts = {}, ...children) {
  const node = document.createElement(tag);
  if (opts.className) node.className = opts.className;
  if (opts.text !== undefined) node.textContent = opts.text;
  if (opts.title) node.title = opts.title;
  if (opts.attrs) for (const [k, v] of Object.entries(opts.attrs)) node.setAttribute(k, v);
  if (opts.dataset) Object.assign(node.dataset, opts.dataset);
  if (opts.on) for (const [k, v] of Object.entries(opts.on)) node.addEventListener(k, v);
  for (const c of children) if (c !== null && c !== undefined && c !== false) node.append(c);
  return node;
}

/** The characters of `text` as a reader counts them: an emoji of several code points is one. */
function* characters(text) {
  if (typeof Intl.Segmenter !== 'function') { yield* text; return; } // code points, at least
  for (const { segment } of new Intl.Segmenter().segment(text)) yield segment;
}

/**
 * `text` if it has at most `max` characters, else its first `max - 3` and "…". Cut by
 * characters, not UTF-16 units: half an emoji would show as U+FFFD, and be saved so.
 */
export function clip(text, max) {
  const kept = [];
  for (const ch of characters(text)) {
    if (kept.length === max) return `${kept.slice(0, max - 3).join('').trimEnd()}…`;
    kept.push(ch);
  }
  return text;
}

export function formatInt(n) {
  return Number(n).toLocaleString('en-US');
}

/** 8192 -> "8K", 131072 -> "128K", 1000 -> "1,000". */
export function formatContext(n) {
  if (!n) return '';
  if (n >= 1024 && n % 1024 === 0) return `${n / 1024}K`;
  return formatInt(n);
}

export function formatSeconds(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

export function uid() {
  if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

export function relativeTime(ts) {
  const d = Date.now() - ts;
  if (d < 60e3) return 'just now';
  if (d < 3600e3) return `${Math.floor(d / 60e3)} min ago`;
  if (d < 86400e3) return `${Math.floor(d / 3600e3)} h ago`;
  return new Date(ts).toLocaleDateString();
}
