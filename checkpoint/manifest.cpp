#include "checkpoint/manifest.h"

#include <iomanip>
#include <sstream>

#include <boost/archive/text_iarchive.hpp>
#include <boost/archive/text_oarchive.hpp>
#include <boost/serialization/string.hpp>
#include <boost/serialization/version.hpp>

#include "checkpoint/checkpoint_error.h"
#include "smp_core/errors.h"

namespace boost::serialization {
template <class Archive>
void serialize(Archive& ar, smp::checkpoint::Manifest& m, const unsigned int version) {
  ar & m.format_version & m.save_id & m.save_time_ns & m.partial & m.part & m.parts;
  ar & m.world_size & m.pp_size & m.dp_size & m.plan_hash & m.payload_size & m.payload_hash;
  ar & m.torch_version;
  if (version >= 1) ar & m.entries_offset & m.entries_size & m.entries_hash & m.entry_chunk;
}
}  // namespace boost::serialization

// Class version 1 (format version 2) appends the entry table's place; a version 0
// manifest (format version 1) reads with those fields 0.
BOOST_CLASS_VERSION(smp::checkpoint::Manifest, 1)

namespace smp::checkpoint {

std::string Manifest::encode() const {
  std::ostringstream os;
  {
    boost::archive::text_oarchive ar(os, boost::archive::no_header);
    ar << *this;
  }
  return os.str();
}

Manifest Manifest::decode(const std::string& text, const std::string& path) {
  Manifest m;
  try {
    std::istringstream is(text);
    boost::archive::text_iarchive ar(is, boost::archive::no_header);
    ar >> m;
  } catch (const std::exception& e) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': manifest unreadable (",
                                  e.what(), ")"));
  }
  return m;
}

std::string Manifest::describe() const {
  std::ostringstream os;
  os << "save 0x" << std::hex << std::setw(16) << std::setfill('0') << save_id << std::dec;
  if (partial) {
    os << " part " << part << " of " << parts;
  } else {
    os << " full";
  }
  os << " (world " << world_size << " = pp " << pp_size << " x dp " << dp_size << ")";
  return os.str();
}

}  // namespace smp::checkpoint
