// Safe markdown renderer for untrusted model output.
//
// Rules this module keeps:
//  * model text only ever reaches the DOM through text nodes (textContent /
//    createTextNode), never through innerHTML, so raw HTML in the text is shown
//    as text and cannot run;
//  * links are made only for http: and https: URLs; anything else
//    (javascript:, data:, relative, ...) is rendered as plain text;
//  * images are never loaded: ![alt](url) becomes a link to the URL.
//
// Supported: headings, paragraphs (single newlines become <br>), **bold**,
// *italic*, ~~strike~~, `code`, [links](https://...), bare https:// URLs,
// block quotes, ordered/unordered (nested) lists, pipe tables, horizontal rules
// and fenced code blocks (with highlighting and a copy button). An unclosed
// fence (a reply still streaming) runs to the end of the text.

import { highlight } from './highlight.js';
import { copyText } from './util.js';

const MAX_DEPTH = 12;
// Brackets of a link's text, or parentheses of its URL, nested deeper than this are no link
// (as in cmark): each unclosed one would otherwise be searched to the end of the text.
const MAX_LINK_NESTING = 32;

const RE = {
  fence: /^( {0,3})(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/,
  heading: /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/,
  hr: /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/,
  quote: /^ {0,3}> ?(.*)$/,
  item: /^([ \t]*)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/,
  tableSep: /^[ \t]*\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/,
  blank: /^[ \t]*$/,
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/**
 * `node` with `children` and dir=auto, set after them: Chromium works a dir=auto element's
 * direction out again for each child put in (or taken out), which is quadratic in a
 * paragraph of many lines.
 */
function withAutoDir(node, children) {
  node.append(...children);
  node.dir = 'auto';
  return node;
}

/** The children of paragraph `p`, to go in another element (its dir=auto off first: see withAutoDir). */
function unwrap(p) {
  p.removeAttribute('dir');
  return [...p.childNodes];
}

function indentOf(line) {
  let n = 0;
  for (const ch of line) {
    if (ch === ' ') n += 1;
    else if (ch === '\t') n += 4 - (n % 4);
    else break;
  }
  return n;
}

function stripIndent(line, count) {
  let n = 0;
  let i = 0;
  while (i < line.length && n < count) {
    if (line[i] === ' ') n += 1;
    else if (line[i] === '\t') n += 4 - (n % 4);
    else break;
    i += 1;
  }
  return line.slice(i);
}

/** True when `url` may become a clickable link (http and https only). */
export function safeUrl(url) {
  const u = (url || '').trim();
  if (!/^https?:\/\//i.test(u)) return null;
  // Reject control characters and whitespace, which browsers strip or mangle.
  if (/[\u0000-\u0020\u007f]/.test(u)) return null;
  try {
    const parsed = new URL(u);
    if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') return null;
    return parsed.href;
  } catch {
    return null;
  }
}

function makeLink(href, children) {
  const a = el('a');
  a.href = href;
  a.target = '_blank';
  a.rel = 'noopener noreferrer nofollow';
  a.title = href;
  for (const c of children) a.appendChild(c);
  return a;
}

// ---------------------------------------------------------------- inline ---

const PUNCT = /[!-/:-@[-`{-~]/;

function findClosingBracket(s, start) {
  // s[start] === '['; returns the index of the matching ']' or -1.
  let depth = 0;
  for (let i = start; i < s.length; i++) {
    const ch = s[i];
    if (ch === '\\') { i++; continue; }
    if (ch === '`') {
      const end = s.indexOf('`', i + 1);
      if (end !== -1) { i = end; continue; }
    }
    if (ch === '[') { depth++; if (depth > MAX_LINK_NESTING) return -1; }
    else if (ch === ']') { depth--; if (depth === 0) return i; }
  }
  return -1;
}

function parseLinkTarget(s, start) {
  // s[start] === '('; returns {url, end} where end is the index after ')'.
  let i = start + 1;
  while (s[i] === ' ') i++;
  let url = '';
  if (s[i] === '<') {
    // <url>: on one line, with no other '<' in it (so an unclosed one is not searched to the end).
    let close = i + 1;
    while (close < s.length && !'<>\n'.includes(s[close])) close++;
    if (s[close] !== '>') return null;
    url = s.slice(i + 1, close);
    i = close + 1;
  } else {
    let depth = 0;
    const from = i;
    for (; i < s.length; i++) {
      const ch = s[i];
      if (ch === '\\') { i++; continue; }
      if (ch === '(') { depth++; if (depth > MAX_LINK_NESTING) return null; }
      else if (ch === ')') { if (depth === 0) break; depth--; }
      else if (ch === ' ' || ch === '\n') break;
    }
    url = s.slice(from, i);
  }
  while (s[i] === ' ') i++;
  if (s[i] === '"' || s[i] === "'") {
    const close = s.indexOf(s[i], i + 1);
    if (close === -1) return null;
    i = close + 1;
    while (s[i] === ' ') i++;
  }
  if (s[i] !== ')') return null;
  return { url, end: i + 1 };
}

/**
 * `find(from)`: the index of the closer `key` at or after `from`, or -1. Where it found none
 * is kept in `noneFrom` (a Map, one per text), and later searches from there on answer -1 at
 * once: openers are met left to right, and without this each one that never closes would
 * search to the end of the text again (quadratic). Only for closers that do not depend on
 * where the search starts: none after `from` means none after any later point.
 */
function closerFrom(noneFrom, key, from, find) {
  if (from >= (noneFrom.get(key) ?? Infinity)) return -1;
  const j = find(from);
  if (j === -1) noneFrom.set(key, from);
  return j;
}

/**
 * The end of a TeX math span starting at s[i] ($$..$$, \\[..\\], \\(..\\), $..$), or -1.
 * A single $ follows pandoc's rule, so prices are not math: the opening $ has no space
 * after it, the closing one no space before it and no digit after it, on the same line.
 */
function findMathEnd(s, i, noneFrom) {
  for (const [open, close] of [['$$', '$$'], ['\\[', '\\]'], ['\\(', '\\)']]) {
    if (!s.startsWith(open, i)) continue;
    const j = closerFrom(noneFrom, close, i + 2, (from) => s.indexOf(close, from));
    return j > i + 2 ? j + 2 : -1;
  }
  if (s[i] !== '$' || !s[i + 1] || /\s/.test(s[i + 1])) return -1;
  for (let j = i + 1; j < s.length && s[j] !== '\n'; j++) {
    if (s[j] === '\\') { j++; continue; }
    if (s[j] === '$') return /\s/.test(s[j - 1]) || /\d/.test(s[j + 1] || '') ? -1 : j + 1;
  }
  return -1;
}

function isWordChar(ch) {
  return !!ch && /[\p{L}\p{N}_]/u.test(ch);
}

function findEmphasisClose(s, from, delim) {
  // Closing delimiter: not preceded by whitespace; for single '*'/'_' not part
  // of a longer run; for '_' not followed by a word character.
  let i = from;
  while (i < s.length) {
    const j = s.indexOf(delim, i);
    if (j === -1) return -1;
    if (s[j - 1] === '\\') { i = j + 1; continue; }
    const before = s[j - 1];
    const after = s[j + delim.length];
    const single = delim.length === 1;
    if (j > from && before && !/\s/.test(before) &&
        !(single && after === delim[0]) &&
        !(single && s[j - 1] === delim[0]) &&
        !(delim[0] === '_' && isWordChar(after))) {
      return j;
    }
    i = j + delim.length;
  }
  return -1;
}

function findCodeClose(s, from, fence) {
  // The next run of exactly fence.length backticks at or after `from`, or -1.
  let j = from;
  while ((j = s.indexOf(fence, j)) !== -1) {
    if (s[j + fence.length] !== '`' && s[j - 1] !== '`') return j;
    while (s[j] === '`') j++;
  }
  return -1;
}

/** A bare URL without the punctuation that ends its sentence; a ")" is kept only when it closes a "(" in it. */
function trimUrlEnd(url) {
  const open = url.split('(').length - 1;
  let close = url.split(')').length - 1;
  for (;;) {
    const last = url[url.length - 1];
    if ('.,:;!?*_~]}'.includes(last)) url = url.slice(0, -1);
    else if (last === ')' && open < close) { url = url.slice(0, -1); close--; }
    else return url;
  }
}

/**
 * Parse inline markdown in `s` and return an array of DOM nodes. Inside a link's text
 * (`inLink`) links are shown as their text: a link never holds another one.
 */
export function parseInline(s, depth = 0, inLink = false) {
  const out = [];
  let text = '';
  const flush = () => {
    if (text) out.push(document.createTextNode(text));
    text = '';
  };
  if (depth > MAX_DEPTH) return [document.createTextNode(s)];
  const noneFrom = new Map(); // see closerFrom
  let noUrlBefore = 0;

  let i = 0;
  while (i < s.length) {
    const ch = s[i];

    // TeX math is shown as written: no emphasis or escapes inside it.
    const mathEnd = ch === '$' || ch === '\\' ? findMathEnd(s, i, noneFrom) : -1;
    if (mathEnd !== -1) {
      flush();
      out.push(el('span', 'math', s.slice(i, mathEnd)));
      i = mathEnd;
      continue;
    }

    // Backslash escapes and hard line breaks.
    if (ch === '\\' && s[i + 1] === '\n') {
      flush();
      out.push(el('br'));
      i += 2;
      continue;
    }
    if (ch === '\\' && i + 1 < s.length && PUNCT.test(s[i + 1])) {
      text += s[i + 1];
      i += 2;
      continue;
    }
    if (ch === '\n') {
      flush();
      out.push(el('br'));
      i += 1;
      continue;
    }

    // Code span.
    if (ch === '`') {
      let n = 0;
      while (s[i + n] === '`') n++;
      const fence = '`'.repeat(n);
      const close = closerFrom(noneFrom, fence, i + n, (from) => findCodeClose(s, from, fence));
      if (close !== -1) {
        let code = s.slice(i + n, close).replace(/\n/g, ' ');
        if (/^ .* $/.test(code) && code.trim()) code = code.slice(1, -1);
        flush();
        out.push(el('code', 'inline', code));
        i = close + n;
        continue;
      }
      text += fence;
      i += n;
      continue;
    }

    // Autolink <https://...>.
    if (ch === '<' && !inLink) {
      const m = /^<(https?:\/\/[^\s<>]+)>/i.exec(s.slice(i));
      if (m) {
        const href = safeUrl(m[1]);
        if (href) {
          flush();
          out.push(makeLink(href, [document.createTextNode(m[1])]));
          i += m[0].length;
          continue;
        }
      }
    }

    // Image ![alt](url) -> link (images are never loaded), or link [text](url).
    if (ch === '[' || (ch === '!' && s[i + 1] === '[')) {
      const image = ch === '!';
      const open = image ? i + 1 : i;
      const close = findClosingBracket(s, open);
      if (close !== -1 && s[close + 1] === '(') {
        const target = parseLinkTarget(s, close + 1);
        if (target) {
          const label = s.slice(open + 1, close);
          const href = inLink ? null : safeUrl(target.url);
          flush();
          const children = image
            ? [document.createTextNode(`[image: ${label || target.url}]`)]
            : parseInline(label, depth + 1, true);
          if (href) out.push(makeLink(href, children));
          else out.push(...children); // unsafe or relative URL, or inside a link's text: text only
          i = target.end;
          continue;
        }
      }
    }

    // Bare URL.
    if ((ch === 'h' || ch === 'H') && i >= noUrlBefore && !isWordChar(s[i - 1])) {
      const m = /^https?:\/\/[^\s<>"'`]+/i.exec(s.slice(i));
      if (m) {
        const url = trimUrlEnd(m[0]);
        const href = !inLink && /^https?:\/\/[^/?#\s]+/i.test(url) ? safeUrl(url) : null;
        if (href) {
          flush();
          out.push(makeLink(href, [document.createTextNode(url)]));
          i += url.length;
          continue;
        }
        // Not a link: no other one starts in its characters (each would be read to their end again).
        noUrlBefore = i + m[0].length;
      }
    }

    // Emphasis: ***x***, **x**, __x__, *x*, _x_, ~~x~~.
    if (ch === '*' || ch === '_' || (ch === '~' && s[i + 1] === '~')) {
      let run = 0;
      while (s[i + run] === ch) run++;
      // No intraword "_" emphasis (snake_case) nor single "*" (2*3*4).
      const canOpen = i + run < s.length && !/\s/.test(s[i + run]) &&
        !((ch === '_' || (ch === '*' && run === 1)) && isWordChar(s[i - 1]));
      if (canOpen) {
        const tries = ch === '~' ? [2] : run >= 3 ? [3, 2, 1] : run === 2 ? [2, 1] : [1];
        let done = false;
        for (const n of tries) {
          const delim = ch.repeat(n);
          const close = closerFrom(noneFrom, delim, i + n, (from) => findEmphasisClose(s, from, delim));
          if (close !== -1) {
            const inner = s.slice(i + n, close);
            flush();
            let node;
            if (ch === '~') node = el('del');
            else if (n === 3) { node = el('strong'); const em = el('em'); em.append(...parseInline(inner, depth + 1, inLink)); node.appendChild(em); }
            else node = el(n === 2 ? 'strong' : 'em');
            if (n !== 3) node.append(...parseInline(inner, depth + 1, inLink));
            out.push(node);
            i = close + n;
            done = true;
            break;
          }
        }
        if (done) continue;
      }
      text += ch.repeat(run);
      i += run;
      continue;
    }

    text += ch;
    i += 1;
  }
  flush();
  return out;
}

// ----------------------------------------------------------------- blocks ---

function codeBlock(code, lang) {
  const wrap = el('div', 'code-block');
  wrap.dir = 'ltr'; // code reads left to right in a right-to-left reply too
  const head = el('div', 'code-head');
  head.appendChild(el('span', 'code-lang', lang || 'text'));
  const btn = el('button', 'code-copy', 'Copy');
  btn.type = 'button';
  btn.title = 'Copy code';
  btn.addEventListener('click', async () => {
    const ok = await copyText(code);
    btn.textContent = ok ? 'Copied' : 'Copy failed';
    btn.classList.toggle('done', ok);
    setTimeout(() => { btn.textContent = 'Copy'; btn.classList.remove('done'); }, 1500);
  });
  head.appendChild(btn);
  const pre = el('pre');
  const codeEl = el('code');
  if (lang) codeEl.dataset.lang = lang;
  codeEl.appendChild(highlight(code, lang));
  pre.appendChild(codeEl);
  wrap.append(head, pre);
  return wrap;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith('|')) s = s.slice(1);
  if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
  const cells = [];
  let cur = '';
  let inCode = false;
  for (let i = 0; i < s.length; i++) {
    const ch = s[i];
    if (ch === '\\' && s[i + 1] === '|') { cur += '|'; i++; continue; }
    if (ch === '`') inCode = !inCode;
    if (ch === '|' && !inCode) { cells.push(cur.trim()); cur = ''; continue; }
    cur += ch;
  }
  cells.push(cur.trim());
  return cells;
}

function table(lines) {
  const header = splitRow(lines[0]);
  const aligns = splitRow(lines[1]).map((c) =>
    c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : '');
  const wrap = el('div', 'table-wrap');
  const t = el('table');
  const thead = el('thead');
  const hr = el('tr');
  header.forEach((cell, k) => {
    const th = el('th');
    if (aligns[k]) th.style.textAlign = aligns[k];
    th.append(...parseInline(cell));
    hr.appendChild(th);
  });
  thead.appendChild(hr);
  t.appendChild(thead);
  const tbody = el('tbody');
  for (const line of lines.slice(2)) {
    const tr = el('tr');
    const cells = splitRow(line);
    for (let k = 0; k < header.length; k++) {
      const td = el('td');
      if (aligns[k]) td.style.textAlign = aligns[k];
      td.append(...parseInline(cells[k] || ''));
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
  t.appendChild(tbody);
  wrap.appendChild(t);
  return wrap;
}

function startsBlock(line, next) {
  return RE.fence.test(line) || RE.heading.test(line) || RE.hr.test(line) || RE.quote.test(line) ||
    (RE.item.test(line) && !!RE.item.exec(line)[3]) ||
    (line.includes('|') && next !== undefined && RE.tableSep.test(next) && next.includes('-'));
}

function parseList(lines, start, depth) {
  const first = RE.item.exec(lines[start]);
  const base = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? 'ol' : 'ul');
  if (ordered) {
    const n = parseInt(first[2], 10);
    if (n !== 1) list.start = n;
  }
  const items = [];
  let loose = false;
  let i = start;
  let cur = null;
  let contentIndent = 0;
  while (i < lines.length) {
    const line = lines[i];
    const m = RE.item.exec(line);
    if (m && indentOf(m[1]) <= base + 1 && /\d/.test(m[2]) === ordered) {
      cur = [m[3] || ''];
      items.push(cur);
      contentIndent = indentOf(m[1]) + m[2].length + 1;
      i++;
      continue;
    }
    if (m && indentOf(m[1]) <= base + 1) break; // a different list type starts
    if (RE.blank.test(line)) {
      let k = i + 1;
      while (k < lines.length && RE.blank.test(lines[k])) k++;
      if (k >= lines.length) { i = k; break; }
      const nm = RE.item.exec(lines[k]);
      const continues = indentOf(lines[k]) >= Math.min(contentIndent, base + 2) ||
        (nm && indentOf(nm[1]) <= base + 1 && /\d/.test(nm[2]) === ordered);
      if (!continues) break;
      loose = true;
      for (let b = i; b < k; b++) cur.push('');
      i = k;
      continue;
    }
    if (indentOf(line) >= base + 2) {
      cur.push(stripIndent(line, Math.min(indentOf(line), contentIndent)));
      i++;
      continue;
    }
    // Lazy continuation of the item's paragraph.
    const prev = cur[cur.length - 1];
    if (prev !== '' && !startsBlock(line, lines[i + 1])) {
      cur.push(line.trim());
      i++;
      continue;
    }
    break;
  }
  for (const itemLines of items) {
    const blocks = parseBlocks(itemLines, depth + 1);
    // Tight list: unwrap paragraphs so items do not get paragraph margins.
    const children = loose ? blocks : blocks.flatMap((c) => (c.tagName === 'P' ? unwrap(c) : [c]));
    list.appendChild(withAutoDir(el('li'), children));
  }
  return { node: list, next: i };
}

/** Parse `lines` (an array of strings) into an array of block DOM nodes. */
export function parseBlocks(lines, depth = 0) {
  const out = [];
  if (depth > MAX_DEPTH) {
    out.push(el('p', '', lines.join('\n')));
    return out;
  }
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (RE.blank.test(line)) { i++; continue; }

    let m = RE.fence.exec(line);
    if (m) {
      const indent = m[1].length;
      const marker = m[2];
      const lang = m[3] || '';
      const body = [];
      i++;
      while (i < lines.length) {
        const l = lines[i];
        const t = l.trim();
        if (t.startsWith(marker[0].repeat(marker.length)) && new RegExp(`^\\${marker[0]}+$`).test(t)) { i++; break; }
        body.push(stripIndent(l, indent));
        i++;
      }
      out.push(codeBlock(body.join('\n'), lang));
      continue;
    }

    m = RE.heading.exec(line);
    if (m) {
      out.push(withAutoDir(el('h' + m[1].length), parseInline(m[2] || '', depth)));
      i++;
      continue;
    }

    if (RE.hr.test(line)) {
      out.push(el('hr'));
      i++;
      continue;
    }

    if (RE.quote.test(line)) {
      const inner = [];
      while (i < lines.length) {
        const q = RE.quote.exec(lines[i]);
        if (q) inner.push(q[1]);
        else if (!RE.blank.test(lines[i]) && inner.length && !RE.blank.test(inner[inner.length - 1]) &&
                 !startsBlock(lines[i], lines[i + 1])) inner.push(lines[i]);
        else break;
        i++;
      }
      const bq = el('blockquote');
      bq.append(...parseBlocks(inner, depth + 1));
      out.push(bq);
      continue;
    }

    m = RE.item.exec(line);
    if (m && (m[3] !== undefined || (i + 1 < lines.length && indentOf(lines[i + 1]) > indentOf(m[1])))) {
      const { node, next } = parseList(lines, i, depth);
      out.push(node);
      i = next;
      continue;
    }

    if (line.includes('|') && i + 1 < lines.length && RE.tableSep.test(lines[i + 1]) && lines[i + 1].includes('-')) {
      const rows = [line, lines[i + 1]];
      i += 2;
      while (i < lines.length && !RE.blank.test(lines[i]) && lines[i].includes('|')) rows.push(lines[i++]);
      out.push(table(rows));
      continue;
    }

    // Paragraph.
    const para = [line.replace(/^[ \t]+/, '')];
    i++;
    while (i < lines.length && !RE.blank.test(lines[i]) && !startsBlock(lines[i], lines[i + 1])) {
      para.push(lines[i].replace(/^[ \t]+/, ''));
      i++;
    }
    // Each paragraph its own direction: replies mix right-to-left and left-to-right text.
    out.push(withAutoDir(el('p'), parseInline(para.join('\n').replace(/[ \t]+$/, ''), depth)));
  }
  return out;
}

/** Render markdown `src` into `container`, replacing its children. */
export function renderMarkdown(src, container) {
  const lines = (src || '').replace(/\r\n?/g, '\n').split('\n');
  const blocks = parseBlocks(lines);
  const dir = container.getAttribute('dir'); // taken off while the blocks go in: see withAutoDir
  container.removeAttribute('dir');
  container.replaceChildren(...blocks);
  if (dir !== null) container.setAttribute('dir', dir);
}

/**
 * Split reasoning out of a reply's content. Handles `<think>...</think>` at the
 * start, an unclosed `<think>` (still thinking), and a bare `...</think>`
 * (templates that open the tag in the prompt).
 * Returns {reasoning, answer, thinking} where thinking means the tag is open.
 */
export function splitThink(content) {
  const text = content || '';
  const lead = text.length - text.trimStart().length;
  const rest = text.slice(lead);
  if (rest.startsWith('<think>')) {
    const close = rest.indexOf('</think>');
    if (close === -1) return { reasoning: rest.slice(7), answer: '', thinking: true };
    return { reasoning: rest.slice(7, close), answer: rest.slice(close + 8).replace(/^\s+/, ''), thinking: false };
  }
  if (rest && '<think>'.startsWith(rest)) return { reasoning: '', answer: '', thinking: false }; // partial tag
  const close = text.indexOf('</think>');
  if (close !== -1 && !text.slice(0, close).includes('<think>')) {
    return { reasoning: text.slice(0, close), answer: text.slice(close + 8).replace(/^\s+/, ''), thinking: false };
  }
  return { reasoning: '', answer: text, thinking: false };
}
