// Hardware profiles: YAML in, YAML out. Unknown keys and impossible values are refused with the
// file and key, like the training config.
#include "fuyou/hardware.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "src/formats/yaml_checks.h"

namespace fuyou {

namespace {

class Reader {
 public:
  Reader(YAML::Node node, std::string section, std::string source, std::vector<std::string> known)
      : node_(node),
        section_(std::move(section)),
        source_(std::move(source)),
        known_(std::move(known)) {
    if (node_ && !node_.IsNull() && !node_.IsMap())
      throw ConfigError(str(source_, ": ", section_, ": expected a mapping"));
    if (!node_ || node_.IsNull()) return;
    for (const auto& kv : node_) {
      const std::string& k = kv.first.Scalar();  // load_yaml_checked: keys are scalars
      if (std::find(known_.begin(), known_.end(), k) == known_.end()) {
        std::string allowed;
        for (const auto& s : known_) allowed += (allowed.empty() ? "" : ", ") + s;
        throw ConfigError(str(source_, ": unknown key '", path(k), "' (allowed: ", allowed, ")"));
      }
    }
  }
  std::string path(const std::string& k) const { return section_.empty() ? k : section_ + "." + k; }
  YAML::Node at(const std::string& k) const { return node_ ? node_[k] : YAML::Node(); }
  // A positive number; `scale` converts the file's unit (e.g. GB/s -> bytes/s).
  double positive(const std::string& k, double scale, bool required = true, double def = 0) const {
    YAML::Node v = at(k);
    if (!v || v.IsNull()) {
      if (required) throw ConfigError(str(source_, ": missing key '", path(k), "'"));
      return def;
    }
    double x = 0;
    try {
      x = v.as<double>();
    } catch (const YAML::Exception&) {
      throw ConfigError(str(source_, ": ", path(k), ": expected a number, got '", v.Scalar(), "'"));
    }
    if (!(x > 0) || !std::isfinite(x))
      throw ConfigError(str(source_, ": ", path(k), ": value ", x, " must be > 0"));
    return x * scale;
  }
  uint64_t size(const std::string& k, uint64_t def) const {
    YAML::Node v = at(k);
    if (!v || v.IsNull()) return def;
    return parse_size(v.Scalar(), str(source_, ": ", path(k)));
  }
  std::string text(const std::string& k, const std::string& def) const {
    YAML::Node v = at(k);
    return v && v.IsScalar() ? v.Scalar() : def;
  }
  bool flag(const std::string& k, bool def) const {
    YAML::Node v = at(k);
    if (!v || v.IsNull()) return def;
    try {
      return v.as<bool>();
    } catch (const YAML::Exception&) {
      throw ConfigError(str(source_, ": ", path(k), ": expected true or false"));
    }
  }

 private:
  YAML::Node node_;
  std::string section_, source_;
  std::vector<std::string> known_;
};

// A count read as a number: checked against its range before the conversion to int, which
// is undefined for a double out of int's range.
int whole_number(double x, int lo, int hi, const std::string& source, const std::string& key) {
  if (!(x >= lo && x <= hi) || x != std::floor(x))
    throw ConfigError(
        str(source, ": ", key, ": value ", x, " must be a whole number in ", lo, "..", hi));
  return static_cast<int>(x);
}

HardwareProfile parse_profile_tree(const YAML::Node& root, const std::string& source) {
  HardwareProfile p;
  p.source = source;
  Reader top(root, "", source,
             {"name", "backend", "compute", "pcie", "ssd", "optimizer", "memory"});
  p.name = top.text("name", source);
  p.backend = top.text("backend", "cpu");
  if (p.backend != "cpu" && p.backend != "cuda")
    throw ConfigError(str(source, ": backend: '", p.backend, "' is not one of cpu, cuda"));

  Reader c(top.at("compute"), "compute", source,
           {"peak_tflops", "element_bytes", "gemm_efficiency"});
  p.peak_flops = c.positive("peak_tflops", 1e12);
  p.element_bytes =
      whole_number(c.positive("element_bytes", 1, false, 4), 1, 8, source, "compute.element_bytes");
  if (p.element_bytes != 2 && p.element_bytes != 4)
    throw ConfigError(str(source, ": compute.element_bytes: ", p.element_bytes, " must be 2 or 4"));
  YAML::Node eff = c.at("gemm_efficiency");
  if (!eff || !eff.IsSequence() || eff.size() == 0)
    throw ConfigError(
        str(source, ": compute.gemm_efficiency: expected a list of [size, fraction] pairs"));
  for (size_t i = 0; i < eff.size(); ++i) {
    const YAML::Node& e = eff[i];
    double s = 0, f = 0;
    try {
      if (!e.IsSequence() || e.size() != 2) throw YAML::Exception(YAML::Mark(), "pair");
      s = e[0].as<double>();
      f = e[1].as<double>();
    } catch (const YAML::Exception&) {
      throw ConfigError(
          str(source, ": compute.gemm_efficiency[", i, "]: expected [size, fraction]"));
    }
    if (!(s > 0) || !(f > 0) || f > 1)
      throw ConfigError(str(source, ": compute.gemm_efficiency[", i, "]: size ", s,
                            " must be > 0 and fraction ", f, " in (0, 1]"));
    if (!p.gemm_efficiency.empty() && s <= p.gemm_efficiency.back().first)
      throw ConfigError(str(source, ": compute.gemm_efficiency[", i, "]: sizes must increase (", s,
                            " after ", p.gemm_efficiency.back().first, ")"));
    p.gemm_efficiency.push_back({s, f});
  }

  Reader l(top.at("pcie"), "pcie", source, {"h2d_GBps", "d2h_GBps"});
  p.h2d_Bps = l.positive("h2d_GBps", 1e9);
  p.d2h_Bps = l.positive("d2h_GBps", 1e9);

  Reader s(top.at("ssd"), "ssd", source,
           {"count", "read_GBps", "write_GBps", "mixed", "stripe_unit"});
  p.ssds = whole_number(s.positive("count", 1, false, 1), 1, 1024, source, "ssd.count");
  p.ssd_read_Bps = s.positive("read_GBps", 1e9);
  p.ssd_write_Bps = s.positive("write_GBps", 1e9);
  p.ssd_mixed = s.positive("mixed", 1, false, 1);
  if (p.ssd_mixed < 1 || p.ssd_mixed > 2)
    throw ConfigError(str(source, ": ssd.mixed: ", p.ssd_mixed,
                          " must be in [1, 2] (1: reads and writes take turns, "
                          "2: full duplex)"));
  p.stripe_unit = s.size("stripe_unit", 4ull << 20);
  if (p.stripe_unit == 0 || p.stripe_unit % 4096)
    throw ConfigError(
        str(source, ": ssd.stripe_unit: ", p.stripe_unit, " must be a positive multiple of 4096"));

  Reader o(
      top.at("optimizer"), "optimizer", source,
      {"params_per_s", "formats", "shared_cpu", "compute_share", "optimizer_share", "copy_share"});
  p.optimizer_params_per_s = o.positive("params_per_s", 1);
  {
    // optimizer.formats: {"moments/master": params per second}, each name one the config
    // takes (optimizer.state / optimizer.master).
    std::vector<std::string> all;
    for (const auto& s : optimizer_state_names())
      for (const auto& m : optimizer_master_names()) all.push_back(s + "/" + m);
    Reader formats(o.at("formats"), "optimizer.formats", source, all);
    for (const auto& key : all)
      if (const double r = formats.positive(key, 1, false, 0); r > 0)
        p.optimizer_format_params_per_s.push_back({key, r});
  }
  p.shared_cpu = o.flag("shared_cpu", false);
  p.compute_share = o.positive("compute_share", 1, false, 0.5);
  p.optimizer_share = o.positive("optimizer_share", 1, false, 0.5);
  p.copy_share = o.positive("copy_share", 1, false, 1);
  if (p.compute_share > 1 || p.optimizer_share > 1 || p.copy_share > 1)
    throw ConfigError(str(source,
                          ": optimizer.compute_share, optimizer_share and copy_share must be in "
                          "(0, 1]"));

  Reader m(top.at("memory"), "memory", source, {"device", "host", "host_bandwidth_GBps"});
  p.device_memory = m.size("device", 0);
  p.host_memory = m.size("host", 0);
  p.host_mem_Bps = m.positive("host_bandwidth_GBps", 1e9);
  return p;
}

}  // namespace

double gemm_work_size(const ModelConfig& m, int micro_batch) {
  const double N = static_cast<double>(micro_batch) * m.seq_len, C = m.d_model,
               F = m.d_ff ? m.d_ff : 4.0 * m.d_model;
  return std::cbrt(N * C * F);
}

HardwareProfile parse_hardware_profile(const std::string& yaml_text, const std::string& source) {
  YAML::Node root = load_yaml_checked(yaml_text, source);
  try {
    return parse_profile_tree(root, source);
  } catch (const YAML::Exception& e) {
    throw ConfigError(str(source, ": ", yaml_position(e.mark), ": ", e.msg));
  }
}

HardwareProfile load_hardware_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(str(path, ": cannot read the hardware profile"));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hardware_profile(ss.str(), path);
}

namespace {

// Writes numbers so that they read back as the same double (the shortest such text): six
// significant digits turned two increasing gemm_efficiency sizes into one.
struct Num {
  double v;
};
std::ostream& operator<<(std::ostream& o, Num n) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, n.v);
  return o.write(buf, r.ptr - buf);
}

// A size that reads back exactly: whole GiB or MiB, else bytes.
std::string exact_size(uint64_t b) {
  if (b % (1ull << 30) == 0) return str(b >> 30, "GiB");
  if (b % (1ull << 20) == 0) return str(b >> 20, "MiB");
  return std::to_string(b);
}

}  // namespace

std::string hardware_profile_to_yaml(const HardwareProfile& p, const std::string& header) {
  std::ostringstream o;
  o << header;
  if (!header.empty() && header.back() != '\n') o << "\n";
  // The name comes from the profile or a CPU's model string: quoted, so that a ':' or a
  // control byte in it cannot break the file.
  YAML::Emitter name;
  name << YAML::DoubleQuoted << p.name;
  o << "name: " << name.c_str() << "\nbackend: " << p.backend << "\n";
  o << "compute:\n  peak_tflops: " << Num{p.peak_flops / 1e12}
    << "\n  element_bytes: " << p.element_bytes
    << "\n  gemm_efficiency:  # [cbrt(tokens * d_model * d_ff), fraction of peak]\n";
  for (const auto& [s, f] : p.gemm_efficiency) o << "    - [" << Num{s} << ", " << Num{f} << "]\n";
  o << "pcie:\n  h2d_GBps: " << Num{p.h2d_Bps / 1e9} << "\n  d2h_GBps: " << Num{p.d2h_Bps / 1e9}
    << "\n";
  o << "ssd:\n  count: " << p.ssds << "\n  read_GBps: " << Num{p.ssd_read_Bps / 1e9}
    << "\n  write_GBps: " << Num{p.ssd_write_Bps / 1e9} << "\n  mixed: " << Num{p.ssd_mixed}
    << "\n  stripe_unit: " << p.stripe_unit << "\n";
  o << "optimizer:\n  params_per_s: " << Num{p.optimizer_params_per_s};
  if (!p.optimizer_format_params_per_s.empty()) {
    o << "\n  formats:  # state/master: params per second with bf16 gradients and weights";
    for (const auto& [k, r] : p.optimizer_format_params_per_s) o << "\n    " << k << ": " << Num{r};
  }
  o << "\n  shared_cpu: " << (p.shared_cpu ? "true" : "false")
    << "\n  compute_share: " << Num{p.compute_share}
    << "\n  optimizer_share: " << Num{p.optimizer_share};
  if (p.copy_share != 1) o << "\n  copy_share: " << Num{p.copy_share};
  o << "\n";
  o << "memory:\n";
  if (p.device_memory) o << "  device: " << exact_size(p.device_memory) << "\n";
  if (p.host_memory) o << "  host: " << exact_size(p.host_memory) << "\n";
  o << "  host_bandwidth_GBps: " << Num{p.host_mem_Bps / 1e9} << "\n";
  return o.str();
}

}  // namespace fuyou
