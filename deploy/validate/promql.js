#!/usr/bin/env node
// Gathers every PromQL expression of rendered manifests into one Prometheus rules file, so that
// `promtool check rules` parses them all: the groups of each PrometheusRule as they are (alerting
// rules, their `for` and their annotation templates included), and each query of each Grafana
// dashboard (a ConfigMap labelled grafana_dashboard) as a recording rule, Grafana's variables
// replaced by values that parse ($__rate_interval and its kin by 5m, any other $var by "x", which
// fits the label matchers lossd's dashboard uses them in).
//
// Usage: node promql.js --source=NAME --out=FILE < rendered.yaml
// Exit status: 0 with FILE written (or not written: nothing to check, "0 expression(s)" printed);
// 1 when a dashboard is not JSON (printed as "ERROR <source>: <Kind>/<name>: <what>"); 2 on usage.
'use strict';

const fs = require('fs');
const YAML = require('yaml');

const GRAFANA_RANGES = /\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}/g;
const GRAFANA_VARIABLES = /\$\{\w+(:\w+)?\}|\$\w+/g;

function dashboardQueries(panels, out) {
  for (const panel of panels || []) {
    for (const target of panel.targets || []) {
      if (typeof target.expr === 'string' && target.expr.trim() !== '') {
        out.push({ panel: panel.id, title: panel.title || '', refId: target.refId || '', expr: target.expr });
      }
    }
    dashboardQueries(panel.panels, out);  // panels nested in collapsed rows
  }
  return out;
}

function main(argv) {
  let source = '<stdin>';
  let outFile = null;
  for (const arg of argv) {
    if (arg.startsWith('--source=')) source = arg.slice('--source='.length);
    else if (arg.startsWith('--out=')) outFile = arg.slice('--out='.length);
    else {
      process.stderr.write(`promql.js: unknown argument ${arg}\n`);
      return 2;
    }
  }
  if (!outFile) {
    process.stderr.write('usage: promql.js --source=NAME --out=FILE < rendered.yaml\n');
    return 2;
  }
  const docs = YAML.parseAllDocuments(fs.readFileSync(0, 'utf8')).map((d) => d.toJS()).filter((d) => d && typeof d === 'object');
  const groups = [];
  const problems = [];
  let count = 0;
  for (const doc of docs) {
    const name = `${doc.kind}/${(doc.metadata || {}).name}`;
    if (doc.kind === 'PrometheusRule') {
      for (const group of ((doc.spec || {}).groups || [])) {
        groups.push({ ...group, name: `${name}: ${group.name}` });
        count += (group.rules || []).length;
      }
    }
    const labels = (doc.metadata || {}).labels || {};
    if (doc.kind === 'ConfigMap' && labels.grafana_dashboard !== undefined) {
      for (const [key, text] of Object.entries(doc.data || {})) {
        let dashboard;
        try {
          dashboard = JSON.parse(text);
        } catch (err) {
          problems.push(`${source}: ${name}: data[${JSON.stringify(key)}]: not JSON: ${err.message}`);
          continue;
        }
        const rules = dashboardQueries(dashboard.panels, []).map((q) => ({
          record: `dashboard:panel_${q.panel}:${q.refId.replace(/[^A-Za-z0-9_]/g, '_') || 'query'}`,
          expr: q.expr.replace(GRAFANA_RANGES, '5m').replace(GRAFANA_VARIABLES, 'x'),
          labels: { panel_title: q.title },
        }));
        if (rules.length > 0) groups.push({ name: `${name}: ${key}`, rules });
        count += rules.length;
      }
    }
  }
  for (const p of problems) process.stdout.write(`ERROR ${p}\n`);
  if (problems.length > 0) return 1;
  if (groups.length > 0) fs.writeFileSync(outFile, YAML.stringify({ groups }));
  process.stdout.write(`${count} expression(s)\n`);
  return 0;
}

if (require.main === module) process.exitCode = main(process.argv.slice(2));
