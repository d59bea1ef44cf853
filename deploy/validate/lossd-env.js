#!/usr/bin/env node
// Prints how a rendered manifest starts lossd, so a test can start the real binary the same way:
// one line per FLAGS_* variable of the ConfigMaps its container loads, then "ARGS" and one
// argument per line. Usage: kubectl kustomize DIR | node lossd-env.js
'use strict';

const fs = require('fs');
const YAML = require('yaml');

const docs = YAML.parseAllDocuments(fs.readFileSync(0, 'utf8')).map((d) => d.toJS()).filter(Boolean);
const configMaps = new Map(docs.filter((d) => d.kind === 'ConfigMap').map((d) => [d.metadata.name, d.data || {}]));
const workload = docs.find((d) => d.kind === 'StatefulSet');
const container = workload && (workload.spec.template.spec.containers || []).find((c) => c.name === 'lossd');
if (!container) {
  process.stderr.write('lossd-env.js: no StatefulSet with a container named lossd\n');
  process.exit(1);
}
for (const ref of container.envFrom || []) {
  const data = ref.configMapRef ? configMaps.get(ref.configMapRef.name) || {} : {};
  for (const [key, value] of Object.entries(data)) process.stdout.write(`${key}=${value}\n`);
}
for (const e of container.env || []) if (typeof e.value === 'string') process.stdout.write(`${e.name}=${e.value}\n`);
process.stdout.write('ARGS\n');
for (const arg of container.args || []) process.stdout.write(`${arg}\n`);
