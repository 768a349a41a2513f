// Small, dependency-free syntax highlighter for fenced code blocks.
//
// It never touches innerHTML: code is split into tokens by one regular
// expression per language and each token becomes a text node, wrapped in a
// <span class="tok-KIND"> when it is not plain text.

const C_LIKE_KW =
  'auto break case catch char class const constexpr continue default delete do double else enum explicit ' +
  'extern false final float for friend goto if import inline int long namespace new noexcept nullptr operator ' +
  'override package private protected public register return short signed sizeof static struct super switch ' +
  'template this throw true try typedef typename union unsigned using virtual void volatile while ' +
  'abstract boolean byte extends implements instanceof interface native synchronized throws transient ' +
  'func go chan defer fallthrough map range select type var nil ' +
  'fn let mut impl trait pub crate mod use match loop move ref self Self where async await dyn unsafe ' +
  'bool string uint8 int8 int16 int32 int64 uint16 uint32 uint64 float32 float64 size_t u8 u16 u32 u64 ' +
  'i8 i16 i32 i64 f32 f64 usize isize val fun object when is in as internal data sealed lateinit';

const LANGS = {
  python: {
    kw:
      'False None True and as assert async await break class continue def del elif else except finally for ' +
      'from global if import in is lambda nonlocal not or pass raise return try while with yield match case self',
    builtins:
      'print len range int str float list dict set tuple bool open enumerate zip map filter sorted sum min max ' +
      'isinstance super type abs any all iter next repr hasattr getattr setattr',
    lineComment: '#',
    strings: ['"""[\\s\\S]*?(?:"""|$(?![\\s\\S]))', "'''[\\s\\S]*?(?:'''|$(?![\\s\\S]))", '[rbfuRBFU]{0,2}"(?:\\\\.|[^"\\\\\\n])*"?', "[rbfuRBFU]{0,2}'(?:\\\\.|[^'\\\\\\n])*'?"],
    decorators: true,
  },
  javascript: {
    kw:
      'async await break case catch class const continue debugger default delete do else export extends false ' +
      'finally for from function if import in instanceof let new null of return static super switch this throw ' +
      'true try typeof undefined var void while with yield interface type enum implements private public ' +
      'protected readonly as any number string boolean never unknown declare namespace abstract keyof',
    builtins: 'console window document Math JSON Promise Array Object String Number Map Set Error fetch require module',
    lineComment: '//',
    blockComment: true,
    strings: ['`(?:\\\\.|[^`\\\\])*`?', '"(?:\\\\.|[^"\\\\\\n])*"?', "'(?:\\\\.|[^'\\\\\\n])*'?"],
  },
  c: {
    kw: C_LIKE_KW,
    builtins: 'printf std cout cin endl vector string println fmt String Vec Option Some None Ok Err Box malloc free',
    lineComment: '//',
    blockComment: true,
    preprocessor: true,
    strings: ['"(?:\\\\.|[^"\\\\\\n])*"?', "'(?:\\\\.|[^'\\\\\\n]){0,4}'"],
  },
  bash: {
    kw:
      'if then else elif fi for while until do done case esac in function return local export readonly ' +
      'declare unset set shift exit source alias echo cd sudo',
    builtins: 'ls cat grep sed awk curl wget pip python git mkdir rm cp mv chmod chown apt apt-get npm docker',
    lineComment: '#',
    strings: ['"(?:\\\\.|[^"\\\\])*"?', "'[^']*'?"],
    variables: true,
    dashWords: true,
  },
  sql: {
    kw:
      'select from where and or not insert into values update set delete create table drop alter add index ' +
      'primary key foreign references join left right inner outer full on group by order having limit offset ' +
      'as distinct union all case when then else end is null like in between exists count sum avg min max ' +
      'int integer varchar text date timestamp default unique desc asc with view',
    lineComment: '--',
    blockComment: true,
    strings: ["'(?:''|[^'])*'?", '"(?:[^"])*"?'],
    caseInsensitive: true,
  },
  json: {
    kw: 'true false null',
    strings: ['"(?:\\\\.|[^"\\\\\\n])*"?'],
    jsonKeys: true,
  },
  css: {
    kw: 'important media import from to and not only screen',
    dashWords: true,
    lineComment: null,
    blockComment: true,
    strings: ['"(?:\\\\.|[^"\\\\\\n])*"?', "'(?:\\\\.|[^'\\\\\\n])*'?"],
  },
  yaml: {
    kw: 'true false null yes no on off',
    lineComment: '#',
    strings: ['"(?:\\\\.|[^"\\\\\\n])*"?', "'(?:''|[^'\\n])*'?"],
    yamlKeys: true,
  },
  markup: { markup: true },
  generic: {
    kw: 'if else for while return function def class import from true false null None True False var let const',
    lineComment: '//',
    blockComment: true,
    strings: ['"(?:\\\\.|[^"\\\\\\n])*"?', "'(?:\\\\.|[^'\\\\\\n])*'?"],
  },
};

const ALIASES = {
  py: 'python', python3: 'python', python: 'python', ipython: 'python',
  js: 'javascript', jsx: 'javascript', mjs: 'javascript', cjs: 'javascript', javascript: 'javascript',
  ts: 'javascript', tsx: 'javascript', typescript: 'javascript',
  c: 'c', h: 'c', cpp: 'c', 'c++': 'c', cc: 'c', cxx: 'c', hpp: 'c', cuda: 'c', cu: 'c',
  java: 'c', cs: 'c', csharp: 'c', 'c#': 'c', go: 'c', golang: 'c', rust: 'c', rs: 'c',
  kotlin: 'c', kt: 'c', swift: 'c', scala: 'c', dart: 'c', php: 'c',
  sh: 'bash', bash: 'bash', shell: 'bash', zsh: 'bash', console: 'bash', shellsession: 'bash', dockerfile: 'bash',
  sql: 'sql', postgres: 'sql', mysql: 'sql', sqlite: 'sql',
  json: 'json', jsonc: 'json', json5: 'json',
  css: 'css', scss: 'css', less: 'css',
  yaml: 'yaml', yml: 'yaml', toml: 'yaml', ini: 'yaml',
  html: 'markup', xml: 'markup', svg: 'markup', vue: 'markup',
};

const compiled = new Map();

function words(list) {
  return new Set((list || '').split(/\s+/).filter(Boolean));
}

function compile(name) {
  if (compiled.has(name)) return compiled.get(name);
  const def = LANGS[name];
  let result;
  if (def.markup) {
    const re = /(<!--[\s\S]*?(?:-->|$(?![\s\S])))|(<\/?[A-Za-z][\w:-]*)|("[^"]*"?|'[^']*'?)|([A-Za-z_:][\w:.-]*)(?==)|(\/?>)|(&[#\w]+;)/g;
    result = { re, kinds: ['comment', 'tag', 'string', 'attr', 'tag', 'number'] };
  } else {
    const parts = [];
    const kinds = [];
    const comments = [];
    if (def.blockComment) comments.push('/\\*[\\s\\S]*?(?:\\*/|$(?![\\s\\S]))');
    if (def.lineComment) comments.push(def.lineComment.replace(/[.*+?^${}()|[\]\\/]/g, '\\$&') + '.*');
    if (def.preprocessor) comments.push('^[ \\t]*#[ \\t]*[a-z]+\\b.*');
    if (comments.length) { parts.push(comments.join('|')); kinds.push('comment'); }
    if (def.jsonKeys) { parts.push('"(?:\\\\.|[^"\\\\\\n])*"(?=\\s*:)'); kinds.push('attr'); }
    if (def.yamlKeys) { parts.push('^[ \\t-]*[\\w.-]+(?=\\s*[:=])'); kinds.push('attr'); }
    parts.push(def.strings.join('|')); kinds.push('string');
    if (def.decorators) { parts.push('@[\\w.]+'); kinds.push('meta'); }
    if (def.variables) { parts.push('\\$\\{[^}\\n]*\\}?|\\$[\\w@#?*!$-]'); kinds.push('meta'); }
    parts.push('\\b(?:0[xX][0-9a-fA-F_]+|0[bB][01_]+|\\d[\\d_]*(?:\\.\\d[\\d_]*)?(?:[eE][+-]?\\d+)?)[a-zA-Z]{0,3}\\b'); kinds.push('number');
    parts.push('[A-Za-z_$][\\w$]*(?=\\s*\\()'); kinds.push('call');
    parts.push(def.dashWords ? '[A-Za-z_$][\\w$-]*' : '[A-Za-z_$][\\w$]*'); kinds.push('word');
    const re = new RegExp(parts.map((p) => `(${p})`).join('|'), 'gm');
    result = {
      re,
      kinds,
      kw: words(def.caseInsensitive ? def.kw.toLowerCase() : def.kw),
      builtins: words(def.builtins),
      ci: !!def.caseInsensitive,
    };
  }
  compiled.set(name, result);
  return result;
}

/** The LANGS name for a fence's language (the model's text): own keys only, so "constructor" is no language. */
export function languageOf(lang) {
  const key = (lang || '').toLowerCase();
  if (Object.hasOwn(ALIASES, key)) return ALIASES[key];
  return Object.hasOwn(LANGS, key) ? key : 'generic';
}

/** Return a DocumentFragment holding `code` split into highlighted spans. */
export function highlight(code, lang) {
  const frag = document.createDocumentFragment();
  const name = languageOf(lang);
  // Very long blocks are shown plain: the page re-renders while streaming.
  if (code.length > 100000 || (!lang && name === 'generic' && code.length > 20000)) {
    frag.appendChild(document.createTextNode(code));
    return frag;
  }
  const { re, kinds, kw, builtins, ci } = compile(name);
  re.lastIndex = 0;
  let last = 0;
  let plain = '';
  const flush = () => {
    if (plain) frag.appendChild(document.createTextNode(plain));
    plain = '';
  };
  const push = (kind, text) => {
    if (!kind) { plain += text; return; }
    flush();
    const span = document.createElement('span');
    span.className = 'tok-' + kind;
    span.textContent = text;
    frag.appendChild(span);
  };
  let m;
  while ((m = re.exec(code)) !== null) {
    if (m[0] === '') { re.lastIndex++; continue; }
    if (m.index > last) plain += code.slice(last, m.index);
    let group = 1;
    while (group < m.length && m[group] === undefined) group++;
    let kind = kinds[group - 1];
    const text = m[0];
    if (kind === 'word' || kind === 'call') {
      const key = ci ? text.toLowerCase() : text;
      if (kw && kw.has(key)) kind = 'keyword';
      else if (builtins && builtins.has(text)) kind = 'builtin';
      else if (kind === 'word') kind = /^[A-Z][a-z0-9]+[A-Z]?\w*$/.test(text) && name !== 'sql' ? 'type' : null;
      else kind = 'fn';
    }
    push(kind, text);
    last = re.lastIndex;
  }
  plain += code.slice(last);
  flush();
  return frag;
}
