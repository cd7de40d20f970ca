// trainctl dashboard: the page's code. Plain JavaScript, no build step.
//
// Three views, chosen by the URL's fragment: #/ the job list (a page of traind's list,
// filtered by state and name, polled every LIST_POLL_MS), #/job/N one job (its facts, its
// failure, one chart per metric, its log), #/compare/1,2,3 several jobs on one chart per
// metric. Charts are fed by one EventSource on api/stream: the server thins each series to at
// most `buckets` points (mean as the line, min..max as a band) and sends changes as they come.
//
// Every string that came from traind (names, messages, log lines, metric names) goes into the
// page through textContent or as a text node, never as markup: a job's name is whatever its
// submitter typed. dygraphs' legend is HTML, so series labels are built from numbers only.
//
// window.tdash exposes what the page has drawn (points, rows, last steps, latencies), which
// the browser test reads.
'use strict';

const LIST_POLL_MS = 2000;
const LOG_POLL_MS = 3000;
const JOB_POLL_MS = 5000;
const DRAW_GAP_MS = 50; // ms between two redraws of the charts, at least
const LOG_FIRST_PAGES = 10; // pages of the log read at once when a job page opens
const COLORS = ['#2f6fdf', '#e0672b', '#1f8f4e', '#b03fbf', '#c8a400', '#17a2b8', '#c83232', '#6b7385'];
const STATES = ['queued', 'running', 'succeeded', 'failed', 'cancelled'];
const LEVELS = { 3: 'err', 4: 'warning', 5: 'notice', 6: 'info', 7: 'debug' };
// traind's error codes by number (common/td_errno.h; test_dashboard checks this list against
// it): a failed device's code is shown by its name.
const CODE_NAMES = {
  '-4200': 'EINVAL', '-4201': 'ENOMEM', '-4202': 'EIO', '-4203': 'EPROTO', '-4204': 'E2BIG',
  '-4205': 'ENOTFOUND', '-4206': 'EJOB', '-4207': 'EDATA', '-4208': 'ESHAPE', '-4209': 'ENAN',
  '-4210': 'ESTORE', '-4211': 'EDISKFULL', '-4212': 'ECANCELLED', '-4213': 'EPANIC',
  '-4214': 'ECUDA', '-4215': 'EPERM', '-4216': 'ESTATE', '-4217': 'EVERSION', '-4218': 'ECLOSED',
  '-4219': 'EWORKERS', '-4220': 'EABORTED', '-4221': 'EBUSY', '-4222': 'EMPI',
};
function codeName(c) {
  return CODE_NAMES[String(c)] || String(c);
}

// What the test reads.
window.tdash = { draws: 0, series: {}, latency: [], opened: Date.now() / 1000, ready: false };

// ---- small helpers ----

// An element with attributes and children; strings become text nodes.
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.appendChild(typeof c === 'string' || typeof c === 'number' ? document.createTextNode(String(c)) : c);
  }
  return e;
}

function pad(n) { return String(n).padStart(2, '0'); }

function fmtTime(t) {
  if (!t) return '-';
  const d = new Date(t * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtDuration(s) {
  if (!isFinite(s) || s < 0) return '-';
  s = Math.round(s);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${pad(Math.floor(s % 3600 / 60))}m`;
  return `${Math.floor(s / 86400)}d${pad(Math.floor(s % 86400 / 3600))}h`;
}

function fmtValue(v) {
  if (v === null || v === undefined || !isFinite(v)) return '-';
  if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);
  return Number(v).toPrecision(5).replace(/\.?0+(e|$)/, '$1');
}

// A y axis label: short, without the SI prefixes dygraphs would use for small values.
function fmtAxis(v) {
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toPrecision(3).replace(/\.?0+$/, '') + 'M';
  if (a >= 1e4) return (v / 1e3).toPrecision(3).replace(/\.?0+$/, '') + 'k';
  if (a >= 0.01) return String(Number(v.toPrecision(4)));
  return Number(v.toPrecision(3)).toExponential();
}

function fmtCount(n) { return Number(n).toLocaleString('en-US'); }

// Seconds left for a running job, from its progress since it started; NaN when unknown.
function eta(job) {
  if (job.state !== 'running' || !job.started || !(job.step > 0) || !(job.total_steps > job.step)) return NaN;
  const rate = job.step / (Date.now() / 1000 - job.started);
  return rate > 0 ? (job.total_steps - job.step) / rate : NaN;
}

// The latest loss a JOB map's metrics show.
function latestLoss(job) {
  const m = job.metrics || {};
  if (m.train_loss !== undefined) return m.train_loss;
  for (const k of Object.keys(m).sort()) if (k.endsWith('loss')) return m[k];
  return null;
}

function stateBadge(state) {
  return el('span', { class: 'state ' + (STATES.includes(state) ? state : ''), text: state });
}

async function getJSON(url) {
  const r = await fetch(url, { cache: 'no-store' });
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) throw new Error((body && body.error) || `${r.status} ${r.statusText}`);
  return body;
}

function setStatus(text, cls) {
  const s = document.getElementById('status');
  s.textContent = text;
  s.className = 'status ' + (cls || '');
}

function setCrumbs(...parts) {
  const n = document.getElementById('crumbs');
  n.replaceChildren(...parts.flatMap((p, i) => (i ? [' / ', p] : [p])));
}

// ---- views and their lifetime ----

let view = null; // the current view's {stop()}

function route() {
  if (view) view.stop();
  const main = document.getElementById('main');
  main.replaceChildren();
  const h = location.hash.replace(/^#/, '');
  let m;
  if ((m = h.match(/^\/job\/(\d+)$/))) view = jobView(main, [Number(m[1])], false);
  else if ((m = h.match(/^\/compare\/([\d,]+)$/))) {
    const ids = [...new Set(m[1].split(',').filter(Boolean).map(Number))].slice(0, 8);
    view = jobView(main, ids, true);
  } else view = listView(main);
}

// ---- the job list ----

const listState = { states: new Set(), name: '', labels: '', cursors: [0], selected: new Set() };

function listView(main) {
  let timer = null, stopped = false;
  setCrumbs('jobs');
  const stateBoxes = STATES.map(s => {
    const box = el('input', { type: 'checkbox', checked: listState.states.has(s), 'data-state': s });
    box.addEventListener('change', () => {
      if (box.checked) listState.states.add(s); else listState.states.delete(s);
      listState.cursors = [0];
      load();
    });
    return el('label', {}, box, s);
  });
  const name = el('input', { type: 'text', placeholder: 'name pattern (* ? [a-z])', value: listState.name, size: 24 });
  name.addEventListener('change', () => { listState.name = name.value.trim(); listState.cursors = [0]; load(); });
  // labels, as trainctl's --selector: team=vision,env=prod (every one must match)
  const labels = el('input', { type: 'text', id: 'selector', placeholder: 'labels: team=vision,...', value: listState.labels, size: 24 });
  labels.addEventListener('change', () => { listState.labels = labels.value.trim(); listState.cursors = [0]; load(); });
  const compare = el('button', { class: 'primary', id: 'compare' }, 'Compare selected');
  compare.addEventListener('click', () => {
    const ids = [...listState.selected].sort((a, b) => a - b).slice(0, 8);
    if (ids.length) location.hash = '#/compare/' + ids.join(',');
  });
  const newer = el('button', {}, '\u00ab Newer');
  const older = el('button', {}, 'Older \u00bb');
  const pageInfo = el('span', { class: 'muted' });
  newer.addEventListener('click', () => { if (listState.cursors.length > 1) { listState.cursors.pop(); load(); } });
  older.addEventListener('click', () => { if (older.dataset.next) { listState.cursors.push(Number(older.dataset.next)); load(); } });
  const tbody = el('tbody');
  const err = el('div');
  main.append(
    el('h1', {}, 'Jobs'),
    el('div', { class: 'toolbar' }, el('span', { class: 'muted' }, 'state:'), stateBoxes, name, labels, compare),
    err,
    el('table', { class: 'jobs', id: 'jobs' },
      el('thead', {}, el('tr', {}, ['', 'ID', 'Name', 'Owner', 'State', 'Step', 'ETA', 'Devices', 'Loss'].map(t => el('th', {}, t)))),
      tbody),
    el('div', { class: 'pager' }, newer, older, pageInfo));

  function updateCompare() {
    compare.disabled = listState.selected.size === 0;
    compare.textContent = listState.selected.size ? `Compare selected (${listState.selected.size})` : 'Compare selected';
  }

  function row(job) {
    const box = el('input', { type: 'checkbox', checked: listState.selected.has(job.id) });
    box.addEventListener('change', () => {
      if (box.checked) listState.selected.add(job.id); else listState.selected.delete(job.id);
      updateCompare();
    });
    const left = eta(job);
    const step = job.total_steps > 0 ? `${fmtCount(job.step)}/${fmtCount(job.total_steps)}` : fmtCount(job.step);
    return el('tr', { 'data-job': job.id },
      el('td', {}, box),
      el('td', { class: 'num' }, el('a', { href: `#/job/${job.id}` }, String(job.id))),
      el('td', { class: 'name' }, el('a', { href: `#/job/${job.id}`, class: 'job-name' }, job.name)),
      el('td', {}, job.owner || ''),
      el('td', {}, stateBadge(job.state)),
      el('td', { class: 'num' }, step),
      el('td', { class: 'num' }, isFinite(left) ? fmtDuration(left) : ''),
      el('td', {}, job.device_list || `${job.devices}`),
      el('td', { class: 'num' }, fmtValue(latestLoss(job))));
  }

  let seq = 0; // a reply to an older request than the last must not overwrite its answer
  async function load() {
    clearTimeout(timer);
    const mine = ++seq;
    const after = listState.cursors[listState.cursors.length - 1];
    const q = new URLSearchParams({ after, limit: 50, newest: 1 });
    if (listState.states.size) q.set('states', [...listState.states].join(','));
    if (listState.name) q.set('name', listState.name);
    if (listState.labels) q.set('labels', listState.labels);
    try {
      const page = await getJSON('api/jobs?' + q);
      if (stopped || mine !== seq) return;
      err.replaceChildren();
      tbody.replaceChildren(...page.jobs.map(row));
      if (!page.jobs.length) tbody.append(el('tr', {}, el('td', { colspan: 9, class: 'muted' }, 'No jobs match.')));
      older.disabled = !page.more;
      older.dataset.next = page.more ? String(page.next) : '';
      newer.disabled = listState.cursors.length <= 1;
      pageInfo.textContent = `page ${listState.cursors.length}`;
      setStatus('updated ' + new Date().toLocaleTimeString(), 'live');
      window.tdash.ready = true;
    } catch (e) {
      if (stopped || mine !== seq) return;
      err.replaceChildren(el('div', { class: 'error-banner' }, e.message));
      setStatus('cannot reach the dashboard', 'down');
    }
    if (!stopped && mine === seq) timer = setTimeout(load, LIST_POLL_MS);
  }

  updateCompare();
  load();
  return { stop() { stopped = true; clearTimeout(timer); } };
}

// ---- one job, or several on one chart ----

// Exponential moving average of ys (nulls pass through), debiased at the start as
// TensorBoard does, so the first points are not pulled towards zero.
function smooth(ys, a) {
  if (!(a > 0)) return ys;
  const out = new Array(ys.length);
  let acc = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y === null || !isFinite(y)) { out[i] = y; continue; }
    acc = acc * a + (1 - a) * y;
    n++;
    out[i] = acc / (1 - Math.pow(a, n));
  }
  return out;
}

function jobView(main, ids, compare) {
  const opts = { log: false, smoothing: 0, wall: false };
  const jobs = {}; // id -> {info, series: {key: {points, width, rows}}, state, step, total}
  const charts = {}; // key -> {panel, div, graph, dirty, small}
  let es = null, stopped = false, frame = 0, logTimer = null, jobTimer = null;
  for (const id of ids) jobs[id] = { id, info: null, series: {}, color: COLORS[ids.indexOf(id) % COLORS.length] };
  window.tdash.series = {};
  window.tdash.latency = [];
  window.tdash.ready = false;

  setCrumbs(el('a', { href: '#/' }, 'jobs'), compare ? `compare ${ids.join(', ')}` : `job ${ids[0]}`);

  // Controls.
  const logBox = el('input', { type: 'checkbox', id: 'logscale' });
  logBox.addEventListener('change', () => { opts.log = logBox.checked; redrawAll(true); });
  const slider = el('input', { type: 'range', min: 0, max: 0.99, step: 0.01, value: 0, id: 'smoothing' });
  const sliderValue = el('span', { class: 'muted' }, '0.00');
  slider.addEventListener('input', () => {
    opts.smoothing = Number(slider.value);
    sliderValue.textContent = opts.smoothing.toFixed(2);
    redrawAll(false);
  });
  const xStep = el('input', { type: 'radio', name: 'xaxis', value: 'step', checked: true, id: 'x-step' });
  const xWall = el('input', { type: 'radio', name: 'xaxis', value: 'wall', id: 'x-wall' });
  for (const r of [xStep, xWall]) r.addEventListener('change', () => { opts.wall = xWall.checked; redrawAll(true); });

  const head = el('div');
  const failure = el('div');
  const banner = el('div');
  const legend = el('div', { class: 'legend' });
  const grid = el('div', { class: 'charts', id: 'charts' });
  const logPre = el('pre', { id: 'log' });
  const logNote = el('small', { class: 'muted' });
  main.append(...[head, failure, banner,
    el('div', { class: 'toolbar' },
      el('label', {}, logBox, 'log scale'),
      el('label', {}, 'smoothing', slider, sliderValue),
      el('span', {}, 'x axis:'), el('label', {}, xStep, 'step'), el('label', {}, xWall, 'wall time')),
    compare ? legend : null,
    grid,
    compare ? null : el('div', { class: 'log' }, el('h2', {}, 'Log ', logNote), logPre)].filter(Boolean));

  // ---- the facts about a job ----

  function renderHead() {
    if (compare) {
      head.replaceChildren(el('h1', {}, `Compare ${ids.length} jobs`));
      legend.replaceChildren(...ids.map(id => {
        const j = jobs[id], info = j.info;
        return el('span', { 'data-job': id },
          el('span', { class: 'swatch', style: `background:${j.color}` }),
          el('a', { href: `#/job/${id}` }, `job ${id}`), ' ',
          info ? info.name : '', ' ', info ? stateBadge(info.state) : '');
      }));
      failure.replaceChildren();
      return;
    }
    const j = jobs[ids[0]], info = j.info;
    if (!info) return;
    const total = info.total_steps || 0, step = info.step || 0;
    const left = eta(info);
    const fact = (k, v) => el('div', {}, el('span', {}, k), v);
    head.replaceChildren(
      el('h1', {}, `Job ${info.id} `, el('span', { class: 'job-title' }, info.name), ' ', stateBadge(info.state)),
      el('div', { class: 'facts', id: 'facts' },
        fact('step', `${fmtCount(step)}${total ? ' / ' + fmtCount(total) : ''}`),
        total ? el('div', { class: 'progress' }, el('div', { style: `width:${Math.min(100, 100 * step / total).toFixed(1)}%` })) : null,
        fact('ETA', isFinite(left) ? fmtDuration(left) : '-'),
        fact('devices', info.device_list || String(info.devices)),
        Array.isArray(info.nodes) && info.nodes.length
          ? el('div', { id: 'nodes' }, el('span', {}, 'nodes'), `${info.nodes.length}: ${info.nodes.join(', ')}`) : null,
        Array.isArray(info.restarts) && info.restarts.length
          ? el('div', { id: 'restarts' }, el('span', {}, 'restarts'),
            info.restarts.map(r => `${fmtTime(r.time)}: ${r.cause}` + (r.nodes ? `, resumed on ${r.nodes} node(s)` : '')).join('; ')) : null,
        fact('owner', info.owner || '-'),
        fact('created', fmtTime(info.created)),
        fact('started', fmtTime(info.started)),
        fact('ended', fmtTime(info.ended))));
    renderFailure(info);
  }

  function renderFailure(info) {
    const e = info.error;
    if (!e) { failure.replaceChildren(); return; }
    const devs = Array.isArray(e.devices) ? e.devices : [];
    const byNode = devs.some(d => d.node_name !== undefined); // a job that spans nodes
    failure.replaceChildren(el('div', { class: 'failure', id: 'failure' },
      el('h2', {}, `Failed: ${e.name || 'error'}`),
      el('pre', {}, e.message || ''),
      devs.length ? el('table', {},
        el('tr', {}, byNode ? el('th', {}, 'node') : null, el('th', {}, 'device'), el('th', {}, 'code'), el('th', {}, 'message')),
        devs.map(d => el('tr', {}, byNode ? el('td', {}, d.node_name || String(d.node)) : null, el('td', {}, String(d.device)), el('td', {}, codeName(d.code)), el('td', {}, d.message || '')))) : null));
  }

  async function loadInfo() {
    clearTimeout(jobTimer);
    for (const id of ids) {
      try {
        const r = await getJSON('api/job?id=' + id);
        if (stopped) return;
        jobs[id].info = r.job;
      } catch (e) {
        if (stopped) return;
        banner.replaceChildren(el('div', { class: 'error-banner' }, `job ${id}: ${e.message}`));
      }
    }
    renderHead();
    const live = ids.some(id => jobs[id].info && ['queued', 'running'].includes(jobs[id].info.state));
    if (live && !stopped) jobTimer = setTimeout(loadInfo, JOB_POLL_MS);
  }

  // ---- the charts ----

  // Losses first: training, then evaluation; then the other evaluation metrics; then the rest.
  function keyOrder(a, b) {
    const evalKey = k => /^(test|valid|val)_/.test(k);
    const rank = k => (k === 'train_loss' ? 0 : evalKey(k) && /loss/.test(k) ? 1 : evalKey(k) ? 2 : /loss/.test(k) ? 3 : 4);
    return rank(a) - rank(b) || (a < b ? -1 : a > b ? 1 : 0);
  }

  function chartFor(key) {
    if (charts[key]) return charts[key];
    const div = el('div', { class: 'chart' });
    const note = el('small');
    const panel = el('div', { class: 'panel', 'data-key': key, 'data-points': 0, 'data-rows': 0, 'data-last-step': -1 },
      el('div', { class: 'title' }, el('b', {}, key), note), div);
    const c = { key, panel, div, note, graph: null, dirty: true, rebuild: true };
    charts[key] = c;
    // Keep the panels in a stable order: losses first.
    const keys = Object.keys(charts).sort(keyOrder);
    const next = keys[keys.indexOf(key) + 1];
    grid.insertBefore(panel, next ? charts[next].panel : null);
    return c;
  }

  // The chart's data: one row per x, one [low, mid, high] (or null) per job.
  function chartData(key) {
    const cols = ids.map(id => {
      const s = jobs[id].series[key];
      if (!s) return null;
      const mids = smooth(s.points.map(p => p[2]), opts.smoothing);
      return s.points.map((p, i) => [opts.wall ? p[1] * 1000 : p[0],
        p[2] === null ? null : [p[3], mids[i], p[4]]]);
    });
    if (ids.length === 1) return (cols[0] || []).map(([x, v]) => [opts.wall ? new Date(x) : x, v]);
    const rows = new Map();
    cols.forEach((col, j) => {
      if (!col) return;
      for (const [x, v] of col) {
        let r = rows.get(x);
        if (!r) { r = new Array(ids.length + 1).fill(null); r[0] = x; rows.set(x, r); }
        r[j + 1] = v;
      }
    });
    const out = [...rows.values()].sort((a, b) => a[0] - b[0]);
    if (opts.wall) for (const r of out) r[0] = new Date(r[0]);
    return out;
  }

  // The y axis's ticks: dygraphs' own, but where a log axis spans too little for them (a
  // constant series: lr under a constant schedule), its ends and middle, so that it is labelled.
  function yTicker(min, max, pixels, o, g, vals) {
    const ticks = Dygraph.numericTicks(min, max, pixels, o, g, vals);
    if (!opts.log || ticks.filter(t => t.label !== undefined && t.label !== '').length >= 2 ||
        !(min > 0) || !(max > 0))
      return ticks;
    const mid = Math.sqrt(min * max);
    return [min, mid, max].map(v => ({ v, label: fmtAxis(v) }));
  }

  function draw(c) {
    const data = chartData(c.key);
    if (!data.length) return;
    const labels = [opts.wall ? 'time' : 'step', ...ids.map(id => `job ${id}`)];
    const colors = ids.map(id => jobs[id].color);
    const options = {
      labels, colors, file: data, customBars: true, logscale: opts.log,
      connectSeparatedPoints: true, strokeWidth: 1.6, fillAlpha: 0.18,
      drawPoints: data.length <= 60, pointSize: 2.5,
      xlabel: opts.wall ? 'wall time' : 'step', legend: 'onmouseover', animatedZooms: false,
      axes: {
        x: { drawGrid: false },
        y: { axisLabelFormatter: fmtAxis, valueFormatter: fmtValue, axisLabelWidth: 56, ticker: yTicker },
      },
      gridLineColor: '#e6e8ee', axisLineColor: '#b8bfcc',
    };
    if (!c.graph || c.rebuild) {
      if (c.graph) c.graph.destroy();
      c.graph = new Dygraph(c.div, data, options);
      c.rebuild = false;
    } else {
      c.graph.updateOptions({ file: data, logscale: opts.log, drawPoints: data.length <= 60 });
    }
    let points = 0, rows = 0, last = -1, width = 1, series = 0;
    for (const id of ids) {
      const s = jobs[id].series[c.key];
      if (!s) continue;
      series++;
      points += s.points.length;
      rows += s.rows;
      width = Math.max(width, s.width);
      if (s.points.length) last = Math.max(last, s.points[s.points.length - 1][0]);
    }
    c.panel.dataset.series = series;
    c.panel.dataset.points = points;
    c.panel.dataset.rows = rows;
    c.panel.dataset.lastStep = last;
    c.note.textContent = `${fmtCount(rows)} rows` + (width > 1 ? `, ${fmtCount(points)} points (${width} steps each)` : '');
    window.tdash.draws++;
  }

  // Redraws the changed charts at the next frame, but leaves the page at least three times
  // as long as the last redraw took (and DRAW_GAP_MS) to read the stream in between: a
  // replay of a large job sends many events, and redrawing after each would slow it down.
  let lastPass = 0, passMs = 0, timer = 0;
  function schedule() {
    if (frame || timer) return;
    const wait = lastPass + Math.max(DRAW_GAP_MS, 3 * passMs) - performance.now();
    if (wait > 0) {
      timer = setTimeout(() => { timer = 0; schedule(); }, wait);
      return;
    }
    frame = requestAnimationFrame(() => {
      frame = 0;
      const t0 = performance.now();
      for (const c of Object.values(charts)) if (c.dirty) { c.dirty = false; draw(c); }
      lastPass = window.tdash.drawnMs = performance.now();
      passMs = lastPass - t0;
      const now = Date.now() / 1000; // the rows below are on the screen from here
      if (advanceSteps()) renderHead();
      for (const p of pendingLatency) {
        window.tdash.latency.push({ job: p.job, key: p.key, step: p.step, ms: Math.round((now - p.time) * 1000) });
        if (window.tdash.latency.length > 2000) window.tdash.latency.shift();
      }
      pendingLatency.length = 0;
    });
  }

  // Rows say how far a job is before its next status does (traind sends state frames when
  // the state changes): moves each job's step up to its newest row's.
  function advanceSteps() {
    let moved = false;
    for (const id of ids) {
      const j = jobs[id];
      if (!j.info || j.info.state !== 'running') continue;
      for (const s of Object.values(j.series)) {
        const last = s.points.length ? s.points[s.points.length - 1][0] : -1;
        if (last > j.info.step) { j.info.step = last; moved = true; }
      }
    }
    return moved;
  }

  function redrawAll(rebuild) {
    for (const c of Object.values(charts)) { c.dirty = true; if (rebuild) c.rebuild = true; }
    schedule();
  }

  // ---- the live stream ----

  const pendingLatency = [];

  function onSeries(ev, replace) {
    const d = JSON.parse(ev.data);
    const j = jobs[d.job];
    if (!j) return;
    let s = j.series[d.key];
    if (!s) s = j.series[d.key] = { points: [], width: 1, rows: 0 };
    if (replace) s.points = d.points;
    else {
      while (s.points.length && s.points[s.points.length - 1][0] >= d.from) s.points.pop();
      for (const p of d.points) s.points.push(p);
    }
    s.width = d.width;
    s.rows = d.rows;
    const lastP = s.points[s.points.length - 1];
    const key = `${d.job}/${d.key}`;
    window.tdash.series[key] = { points: s.points.length, rows: s.rows, lastStep: lastP ? lastP[0] : -1, width: s.width };
    if (lastP && lastP[1] > window.tdash.opened) pendingLatency.push({ job: d.job, key: d.key, step: lastP[0], time: lastP[1] });
    const c = chartFor(d.key);
    c.dirty = true;
    schedule();
  }

  function onState(ev) {
    const d = JSON.parse(ev.data);
    const j = jobs[d.job];
    if (!j || !j.info) return;
    j.info.state = d.state;
    j.info.step = d.step;
    if (d.total_steps) j.info.total_steps = d.total_steps;
    renderHead();
  }

  function onEnd(ev) {
    const d = JSON.parse(ev.data);
    const j = jobs[d.job];
    if (!j) return;
    if (d.final) j.info = Object.assign({}, j.info || {}, d.final, { owner: j.info ? j.info.owner : '' });
    renderHead();
    if (!compare) loadLog(true);
  }

  function onJobError(ev) {
    const d = JSON.parse(ev.data);
    banner.append(el('div', { class: 'error-banner' }, `job ${d.job}: ${d.message}`));
  }

  function openStream() {
    es = new EventSource('api/stream?jobs=' + ids.join(','));
    es.addEventListener('hello', () => {
      window.tdash.helloMs = performance.now();
      for (const id of ids) jobs[id].series = {};
      window.tdash.series = {};
      setStatus('live', 'live');
    });
    es.addEventListener('series', ev => onSeries(ev, true));
    es.addEventListener('points', ev => onSeries(ev, false));
    es.addEventListener('state', onState);
    es.addEventListener('end', onEnd);
    es.addEventListener('joberror', onJobError);
    es.addEventListener('done', () => {
      window.tdash.doneMs = performance.now();
      es.close();
      setStatus('every job has ended', '');
      window.tdash.done = true;
    });
    es.addEventListener('error', () => {
      if (stopped || window.tdash.done) return;
      setStatus(es.readyState === EventSource.CLOSED ? 'stream closed; reload the page' : 'reconnecting\u2026', 'down');
    });
  }

  // ---- the log ----

  let logAfter = 0, logLines = 0, logBusy = false, logAgain = null;

  // One load at a time, each from where the last one stopped: a second ask while one runs
  // (the job's end while the page's first load is under way) runs after it, never beside it
  // from the same cursor, which showed the lines twice.
  async function loadLog(once) {
    if (logBusy) {
      logAgain = logAgain === null ? once : logAgain && once;
      return;
    }
    logBusy = window.tdash.logBusy = true;
    try {
      await loadLogPages(once);
    } finally {
      logBusy = window.tdash.logBusy = false;
    }
    if (logAgain !== null && !stopped) {
      const again = logAgain;
      logAgain = null;
      loadLog(again);
    }
  }

  async function loadLogPages(once) {
    clearTimeout(logTimer);
    const id = ids[0];
    try {
      for (let i = 0; i < LOG_FIRST_PAGES && !stopped; i++) {
        const r = await getJSON(`api/logs?id=${id}&after=${logAfter}&limit=500`);
        if (stopped) return;
        for (const [t, level, msg] of r.lines) {
          const atBottom = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 4;
          logPre.append(el('span', { class: 'lvl' + level }, `${fmtTime(t)} ${LEVELS[level] || level} ${msg}\n`));
          logLines++;
          if (atBottom) logPre.scrollTop = logPre.scrollHeight;
        }
        logAfter = r.next;
        if (!r.more) break;
      }
      logNote.textContent = `${fmtCount(logLines)} lines`;
    } catch (e) {
      if (stopped) return;
      logNote.textContent = e.message;
      return;
    }
    const info = jobs[id].info;
    if (!once && !stopped && (!info || ['queued', 'running'].includes(info.state)))
      logTimer = setTimeout(() => loadLog(false), LOG_POLL_MS);
  }

  loadInfo().then(() => { window.tdash.ready = true; });
  openStream();
  if (!compare) loadLog(false);
  return {
    stop() {
      stopped = true;
      if (es) es.close();
      clearTimeout(logTimer);
      clearTimeout(jobTimer);
      if (frame) cancelAnimationFrame(frame);
      clearTimeout(timer);
      for (const c of Object.values(charts)) if (c.graph) c.graph.destroy();
    },
  };
}

window.addEventListener('hashchange', route);
window.addEventListener('DOMContentLoaded', route);
