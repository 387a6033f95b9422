#include "checkpoint/parts.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <sstream>

#include "smp_core/errors.h"

namespace smp::checkpoint {
namespace {

struct Part {
  std::string path;
  Manifest manifest;
};

std::string describe_all(const std::vector<Part>& parts) {
  std::ostringstream os;
  for (size_t i = 0; i < parts.size(); ++i) {
    os << (i ? "; " : "") << "'" << parts[i].path << "': " << parts[i].manifest.describe();
  }
  return os.str();
}

}  // namespace

std::string checkpoint_name(const std::string& path) {
  std::string s = path;
  const std::string prev = ".prev";
  if (s.size() > prev.size() && s.compare(s.size() - prev.size(), prev.size(), prev) == 0) {
    s.resize(s.size() - prev.size());
  }
  size_t i = s.size();
  while (i > 0 && std::isdigit(static_cast<unsigned char>(s[i - 1]))) --i;
  if (i == s.size() || i < 2 || s[i - 1] != '_') return path;  // "_3": no name
  return s.substr(0, i - 1);
}

std::vector<std::string> order_parts(const std::vector<std::string>& paths) {
  if (paths.empty()) throw CheckpointError("smp: merge: no part files given");
  std::vector<Part> parts;
  parts.reserve(paths.size());
  for (const auto& p : paths) {
    Manifest m = read_manifest(p);  // names the file: missing, truncated, not smp's
    if (!m.partial) {
      throw CheckpointError(str_cat("smp: merge: '", p, "' is a full checkpoint (", m.describe(),
                                    "), not a part of a partial save: torch.load reads it as is"));
    }
    parts.push_back({p, std::move(m)});
  }
  // One save: every file carries the first file's save id.
  std::set<uint64_t> ids;
  std::set<std::string> names;
  for (const auto& p : parts) {
    ids.insert(p.manifest.save_id);
    names.insert(checkpoint_name(p.path));
  }
  if (ids.size() > 1) {
    const bool one_name = names.size() == 1;
    throw CheckpointError(str_cat(
        "smp: merge: ", one_name ? str_cat("parts of different saves of '", *names.begin(),
                                           "' (mixed save ids: a part was saved again since)")
                                 : std::string("parts of different checkpoints"),
        ": ", describe_all(parts), ". Give the parts of one save, or only the name given to "
        "smp.save (its newest complete save is merged)"));
  }
  const Manifest& first = parts.front().manifest;
  std::map<int, const Part*> by_index;
  for (const auto& p : parts) {
    const Manifest& m = p.manifest;
    if (m.parts != first.parts || m.part < 0 || m.part >= m.parts) {
      throw CheckpointError(str_cat("smp: merge: '", p.path, "' says ", m.describe(), " but '",
                                    parts.front().path, "' says ", first.describe(),
                                    " (damaged manifest)"));
    }
    auto [it, fresh] = by_index.emplace(m.part, &p);
    if (!fresh) {
      throw CheckpointError(str_cat("smp: merge: part ", m.part, " of ", m.describe(),
                                    " is given twice: '", it->second->path, "' and '", p.path, "'"));
    }
  }
  if (static_cast<int>(by_index.size()) != first.parts) {
    std::ostringstream missing;
    const std::string base = checkpoint_name(parts.front().path);
    int n = 0;
    for (int i = 0; i < first.parts; ++i) {
      if (by_index.count(i)) continue;
      missing << (n++ ? ", " : "") << i << " ('" << base << "_" << i << "')";
    }
    std::ostringstream id;
    id << std::hex << first.save_id;
    throw CheckpointError(str_cat("smp: merge: save 0x", id.str(), " has ", first.parts,
                                  " parts; missing part", n > 1 ? "s " : " ", missing.str(),
                                  "; given: ", describe_all(parts)));
  }
  std::vector<std::string> out;
  out.reserve(by_index.size());
  for (const auto& [index, part] : by_index) out.push_back(part->path);
  return out;
}

std::vector<VerifiedFile> read_parts(const std::vector<std::string>& paths) {
  const std::vector<std::string> ordered = order_parts(paths);
  std::vector<VerifiedFile> out;
  out.reserve(ordered.size());
  for (const auto& p : ordered) {
    out.push_back(read_verified(p));
    const Manifest& m = out.back().manifest;
    const Manifest& first = out.front().manifest;
    // The file was replaced between the two reads (a save running meanwhile).
    if (m.save_id != first.save_id || m.part != static_cast<int>(out.size()) - 1) {
      throw CheckpointError(str_cat("smp: merge: '", p, "' changed while being read (now ",
                                    m.describe(), "); is a save still running?"));
    }
  }
  return out;
}

}  // namespace smp::checkpoint
