// lossd's own rules for its manifests: what the schema cannot know (restricted security, probes on
// the right gRPC service, a grace period that outlasts the drain, GPU flags matching GPU limits,
// and references between objects that must resolve).
'use strict';

const POD_TEMPLATE_KINDS = new Set(['StatefulSet', 'Deployment', 'DaemonSet', 'ReplicaSet', 'Job']);
const READINESS_SERVICE = 'lossd.v1.Lossd';
const DEFAULT_DRAIN_SECONDS = 30;

// absl / Go duration syntax ("30s", "1m30s", "1.5h", "250ms") -> seconds; null when malformed.
function durationSeconds(text) {
  const units = { h: 3600, m: 60, s: 1, ms: 1e-3, us: 1e-6, ns: 1e-9 };
  const re = /(\d+(?:\.\d+)?)(h|ms|us|ns|m|s)/gy;
  let total = 0;
  let matched = 0;
  let m;
  while ((m = re.exec(text)) !== null) {
    total += parseFloat(m[1]) * units[m[2]];
    matched = re.lastIndex;
  }
  return matched > 0 && matched === text.length ? total : null;
}

// lossd's --memory_budget syntax (binary K/M/G/T, optional i and B, "auto" = 0); null if malformed.
function lossdBytes(text) {
  const m = /^(\d+)([kmgt]?)i?b?$/.exec(String(text).trim().toLowerCase());
  if (String(text).trim().toLowerCase() === 'auto') return 0;
  if (!m) return null;
  return Number(m[1]) * 2 ** (10 * ' kmgt'.indexOf(m[2] || ' '));
}

// Kubernetes quantity ("8Gi", "512M", "1e9", 1073741824) -> bytes; null if malformed or absent.
function quantityBytes(q) {
  if (typeof q === 'number') return q;
  const m = /^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|e\d+)?$/.exec(String(q));
  if (!m) return null;
  const binary = { Ki: 1, Mi: 2, Gi: 3, Ti: 4, Pi: 5, Ei: 6 };
  const decimal = { k: 1, M: 2, G: 3, T: 4, P: 5, E: 6 };
  const unit = m[2] || '';
  if (unit in binary) return Number(m[1]) * 1024 ** binary[unit];
  if (unit in decimal) return Number(m[1]) * 1000 ** decimal[unit];
  if (unit.startsWith('e')) return Number(m[1]) * 10 ** Number(unit.slice(1));
  return Number(m[1]);
}

function matchesSelector(selector, labels) {
  if (!selector || Object.keys(selector).length === 0) return false;
  return Object.entries(selector).every(([k, v]) => labels && labels[k] === v);
}

// Returns [{source, doc, path, message}] for every rule broken by the set of documents.
function checkPolicy(docs) {
  const problems = [];
  const byKind = (kind) => docs.filter((d) => d.doc.kind === kind);
  const configMaps = new Map(byKind('ConfigMap').map((d) => [d.doc.metadata && d.doc.metadata.name, d.doc]));
  const services = byKind('Service');

  for (const entry of docs) {
    const { doc } = entry;
    const fail = (path, message) => problems.push({ source: entry.source, doc, path, message });

    if (POD_TEMPLATE_KINDS.has(doc.kind)) checkWorkload(doc, configMaps, services, fail);

    if (doc.kind === 'ServiceMonitor') {
      const spec = doc.spec || {};
      const selected = services.filter((s) => matchesSelector((spec.selector || {}).matchLabels, (s.doc.metadata || {}).labels));
      if (selected.length === 0) {
        fail('spec.selector.matchLabels', 'selects no Service among the rendered objects');
      }
      (spec.endpoints || []).forEach((ep, i) => {
        const ok = selected.some((s) => ((s.doc.spec || {}).ports || []).some((p) => p.name === ep.port));
        if (selected.length > 0 && !ok) fail(`spec.endpoints[${i}].port`, `no selected Service has a port named ${JSON.stringify(ep.port)}`);
      });
    }
  }
  return problems;
}

function checkWorkload(doc, configMaps, services, fail) {
  const spec = doc.spec || {};
  const template = spec.template || {};
  const labels = (template.metadata || {}).labels || {};
  const pod = template.spec || {};
  const podSec = pod.securityContext || {};
  const base = 'spec.template.spec';

  if (doc.kind === 'StatefulSet') {
    const svc = services.find((s) => (s.doc.metadata || {}).name === spec.serviceName);
    if (!svc) {
      fail('spec.serviceName', `names Service ${JSON.stringify(spec.serviceName)}, which is not among the rendered objects`);
    } else {
      if ((svc.doc.spec || {}).clusterIP !== 'None') {
        fail('spec.serviceName', `Service ${spec.serviceName} must be headless (clusterIP: None) so clients reach each pod`);
      }
      if (!matchesSelector((svc.doc.spec || {}).selector, labels)) {
        fail('spec.serviceName', `Service ${spec.serviceName}'s selector does not match the pod template's labels`);
      }
    }
  }

  if (!(podSec.seccompProfile && ['RuntimeDefault', 'Localhost'].includes(podSec.seccompProfile.type))) {
    fail(`${base}.securityContext.seccompProfile.type`, 'must be RuntimeDefault (restricted pod security)');
  }
  const tmpVolumes = new Set((pod.volumes || []).filter((v) => v.emptyDir).map((v) => v.name));
  const gpuTolerated = (pod.tolerations || []).some((t) => t.key === 'nvidia.com/gpu' && (t.effect === 'NoSchedule' || !t.effect));

  (pod.containers || []).forEach((c, i) => {
    const at = `${base}.containers[${i}]`;
    const sec = c.securityContext || {};
    if (!(sec.runAsNonRoot === true || (sec.runAsNonRoot === undefined && podSec.runAsNonRoot === true))) {
      fail(`${at}.securityContext.runAsNonRoot`, 'must be true (pod or container level)');
    }
    if (sec.allowPrivilegeEscalation !== false) fail(`${at}.securityContext.allowPrivilegeEscalation`, 'must be false');
    if (sec.privileged === true) fail(`${at}.securityContext.privileged`, 'must not be true');
    if (!((sec.capabilities || {}).drop || []).includes('ALL')) fail(`${at}.securityContext.capabilities.drop`, 'must include ALL');
    if (sec.readOnlyRootFilesystem !== true) {
      fail(`${at}.securityContext.readOnlyRootFilesystem`, 'must be true');
    } else if (!(c.volumeMounts || []).some((m) => m.mountPath === '/tmp' && tmpVolumes.has(m.name))) {
      fail(`${at}.volumeMounts`, 'needs an emptyDir at /tmp (CUDA_CACHE_PATH) with a read-only root filesystem');
    }
    const resources = c.resources || {};
    if (!(resources.requests || {}).memory) fail(`${at}.resources.requests.memory`, 'must be set');
    if (!(resources.limits || {}).memory) fail(`${at}.resources.limits.memory`, 'must be set');

    if (c.name !== 'lossd') return;

    for (const [probe, service] of [['startupProbe', ''], ['livenessProbe', ''], ['readinessProbe', READINESS_SERVICE]]) {
      const grpc = (c[probe] || {}).grpc;
      if (!grpc) {
        fail(`${at}.${probe}.grpc`, 'lossd needs a native gRPC probe here');
      } else if ((grpc.service || '') !== service) {
        fail(`${at}.${probe}.grpc.service`, `must be ${JSON.stringify(service)}, got ${JSON.stringify(grpc.service || '')}`);
      }
    }

    const flags = {};
    (c.envFrom || []).forEach((ref, j) => {
      if (!ref.configMapRef) return;
      const cm = configMaps.get(ref.configMapRef.name);
      if (!cm) {
        if (ref.configMapRef.optional !== true) fail(`${at}.envFrom[${j}].configMapRef.name`, `ConfigMap ${JSON.stringify(ref.configMapRef.name)} is not among the rendered objects`);
        return;
      }
      Object.assign(flags, cm.data || {});
    });
    for (const e of c.env || []) if (typeof e.value === 'string') flags[e.name] = e.value;

    let drain = DEFAULT_DRAIN_SECONDS;
    if (flags.FLAGS_drain_timeout !== undefined) {
      drain = durationSeconds(flags.FLAGS_drain_timeout);
      if (drain === null) {
        fail(`${at}.envFrom`, `FLAGS_drain_timeout ${JSON.stringify(flags.FLAGS_drain_timeout)} is not a duration`);
        drain = DEFAULT_DRAIN_SECONDS;
      }
    }
    const preStopSleep = (((c.lifecycle || {}).preStop || {}).sleep || {}).seconds || 0;
    const grace = pod.terminationGracePeriodSeconds === undefined ? 30 : pod.terminationGracePeriodSeconds;
    if (!(grace > preStopSleep + drain)) {
      fail(`${base}.terminationGracePeriodSeconds`, `${grace}s must exceed preStop sleep ${preStopSleep}s + drain_timeout ${drain}s`);
    }

    // On the CPU device tensors live in the container's memory: the budget must fit under the
    // limit, or the kernel OOM-kills the pod where lossd would have answered RESOURCE_EXHAUSTED.
    if (flags.FLAGS_device !== 'cuda') {
      const budget = lossdBytes(flags.FLAGS_memory_budget || 'auto');
      const limit = quantityBytes((resources.limits || {}).memory);
      if (budget === null) {
        fail(`${at}.envFrom`, `FLAGS_memory_budget ${JSON.stringify(flags.FLAGS_memory_budget)} is not a byte count`);
      } else if (budget === 0) {
        fail(`${at}.envFrom`, 'FLAGS_memory_budget must be set (not auto) unless FLAGS_device=cuda: the default, half the node\'s RAM, ignores the container\'s memory limit');
      } else if (limit !== null && budget >= limit) {
        fail(`${at}.resources.limits.memory`, `${(resources.limits || {}).memory} must exceed FLAGS_memory_budget ${flags.FLAGS_memory_budget}`);
      }
    }

    checkReloadableFiles(c, at, pod, flags, configMaps, fail);

    const gpus = Number((resources.limits || {})['nvidia.com/gpu'] || 0);
    if (flags.FLAGS_device === 'cuda') {
      if (!(gpus >= 1)) fail(`${at}.resources.limits["nvidia.com/gpu"]`, 'FLAGS_device=cuda needs at least one nvidia.com/gpu');
      if (!gpuTolerated) fail(`${base}.tolerations`, 'FLAGS_device=cuda needs a toleration for the nvidia.com/gpu NoSchedule taint');
    } else if (flags.FLAGS_device === 'cpu' && gpus > 0) {
      fail(`${at}.resources.limits["nvidia.com/gpu"]`, 'FLAGS_device=cpu would leave the requested GPU idle');
    }
  });
}

// The files lossd reloads while serving (FLAGS_* -> what they hold). Each must come from a
// ConfigMap, Secret or projected volume mounted as a directory: the kubelet updates such a volume
// by swapping its ..data symlink, which a subPath mount never sees (the pod would keep the old file
// until it restarts, and a restart loses every tensor).
const RELOADED_FILE_FLAGS = ['FLAGS_quota_file', 'FLAGS_tokens_file', 'FLAGS_tls_cert', 'FLAGS_tls_key', 'FLAGS_tls_client_ca'];

function checkReloadableFiles(c, at, pod, flags, configMaps, fail) {
  const volumes = new Map((pod.volumes || []).map((v) => [v.name, v]));
  (pod.volumes || []).forEach((v, i) => {
    if (v.configMap && v.configMap.optional !== true && !configMaps.has(v.configMap.name)) {
      fail(`spec.template.spec.volumes[${i}].configMap.name`, `ConfigMap ${JSON.stringify(v.configMap.name)} is not among the rendered objects`);
    }
  });
  for (const flag of RELOADED_FILE_FLAGS) {
    const file = flags[flag];
    if (typeof file !== 'string' || file === '') continue;
    const mounts = (c.volumeMounts || []).filter((m) => typeof m.mountPath === 'string' &&
      (file === m.mountPath || file.startsWith(m.mountPath.replace(/\/*$/, '/'))));
    mounts.sort((a, b) => b.mountPath.length - a.mountPath.length);
    const mount = mounts[0];
    const volume = mount && volumes.get(mount.name);
    if (!mount || !volume || !(volume.configMap || volume.secret || volume.projected)) {
      fail(`${at}.volumeMounts`, `${flag}=${file} is not in a mounted ConfigMap, Secret or projected volume`);
    } else if (mount.subPath || mount.subPathExpr) {
      fail(`${at}.volumeMounts`, `${flag}=${file} comes through subPath mount ${JSON.stringify(mount.mountPath)}, which Kubernetes never updates: mount the volume's directory so lossd can reload the file`);
    }
  }
}

module.exports = { checkPolicy, durationSeconds, lossdBytes, quantityBytes };
