#!/usr/bin/env node
// Prints how a rendered manifest starts lossd, so a test can start the real binary the same way:
// one line per FLAGS_* variable of the ConfigMaps its container loads, then "ARGS" and one
// argument per line. With --files-into=DIR, the ConfigMaps mounted into the container are written
// under DIR (DIR/<mountPath>/<key>) and variables naming a file in such a mount are rewritten to
// point there, so the binary reads the files the pod would (the quota file, say).
// Usage: kubectl kustomize DIR | node lossd-env.js [--files-into=DIR]
'use strict';

const fs = require('fs');
const path = require('path');
const YAML = require('yaml');

const docs = YAML.parseAllDocuments(fs.readFileSync(0, 'utf8')).map((d) => d.toJS()).filter(Boolean);
const configMaps = new Map(docs.filter((d) => d.kind === 'ConfigMap').map((d) => [d.metadata.name, d.data || {}]));
const workload = docs.find((d) => d.kind === 'StatefulSet');
const container = workload && (workload.spec.template.spec.containers || []).find((c) => c.name === 'lossd');
if (!container) {
  process.stderr.write('lossd-env.js: no StatefulSet with a container named lossd\n');
  process.exit(1);
}
const filesArg = process.argv.slice(2).find((a) => a.startsWith('--files-into='));
const mounted = [];  // [mountPath, local directory]
if (filesArg) {
  const root = filesArg.slice('--files-into='.length);
  const volumes = new Map((workload.spec.template.spec.volumes || []).map((v) => [v.name, v]));
  for (const m of container.volumeMounts || []) {
    const volume = volumes.get(m.name);
    if (!volume || !volume.configMap || m.subPath || !configMaps.has(volume.configMap.name)) continue;
    const dir = path.join(root, m.mountPath);
    fs.mkdirSync(dir, { recursive: true });
    const data = configMaps.get(volume.configMap.name);
    const items = volume.configMap.items || Object.keys(data).map((key) => ({ key, path: key }));
    for (const item of items) fs.writeFileSync(path.join(dir, item.path), data[item.key] || '');
    mounted.push([m.mountPath.replace(/\/*$/, '/'), dir + '/']);
  }
}
const local = (value) => {
  for (const [mountPath, dir] of mounted) if (value.startsWith(mountPath)) return dir + value.slice(mountPath.length);
  return value;
};
for (const ref of container.envFrom || []) {
  const data = ref.configMapRef ? configMaps.get(ref.configMapRef.name) || {} : {};
  for (const [key, value] of Object.entries(data)) process.stdout.write(`${key}=${local(value)}\n`);
}
for (const e of container.env || []) if (typeof e.value === 'string') process.stdout.write(`${e.name}=${local(e.value)}\n`);
process.stdout.write('ARGS\n');
for (const arg of container.args || []) process.stdout.write(`${arg}\n`);
