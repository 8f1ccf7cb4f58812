// Private definitions of the three glibc symbols newer than 2.28 that a current gcc's static
// libstdc++ and libgcc reference, for the manylinux_2_28 link (FH_MANYLINUX, CMakeLists.txt).
//
// Why: the library links libstdc++ and libgcc statically (so it drags no C++ runtime version
// around), but Debian 12's copies were built against glibc 2.36 and call
//   __libc_single_threaded (glibc 2.32)  libstdc++'s reference counts and static-init guards;
//   arc4random             (glibc 2.36)  std::random_device (never used here, linked anyway);
//   _dl_find_object        (glibc 2.35)  libgcc's unwinder, to find the FDE of a frame.
// Linked against glibc 2.28 stubs with -z defs, these would be undefined and the link fails.
// Defined here with hidden visibility, every reference inside libflash_hopper.so binds to these
// definitions at link time, the library exports none of them, and it loads on glibc 2.28.
// Each definition does what glibc 2.28 systems did before the symbol existed. Nothing else of
// the library may need a newer glibc: the link against the stubs proves it (tools/manylinux/).

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

#define FH_COMPAT_PRIVATE __attribute__((visibility("hidden")))

extern "C" {

// 0 = "other threads may exist": libstdc++ then always uses atomic reference counts and
// locked static-init guards, which is what it did on every glibc before 2.32. Never set to 1:
// this library cannot know when the process is single-threaded.
FH_COMPAT_PRIVATE char __libc_single_threaded = 0;

// 32 random bits from the kernel (getentropy, glibc 2.25). arc4random cannot fail by contract,
// so an error other than EINTR aborts, as glibc's own arc4random does when getrandom fails.
FH_COMPAT_PRIVATE uint32_t arc4random(void) noexcept {
  uint32_t value = 0;
  while (getentropy(&value, sizeof(value)) != 0) {
    if (errno != EINTR) {
      abort();
    }
  }
  return value;
}

}  // extern "C"

// glibc >= 2.35 headers declare struct dl_find_object (and libgcc built against them calls
// _dl_find_object); an older libgcc does not reference it and needs no definition.
#ifdef DLFO_STRUCT_HAS_EH_DBASE

namespace {

struct FindQuery {
  uintptr_t pc;
  dl_find_object* out;
};

// dl_iterate_phdr callback: fill q->out from the loaded object whose PT_LOAD segments hold pc.
int find_object_of_pc(dl_phdr_info* info, size_t /*size*/, void* data) {
  auto* q = static_cast<FindQuery*>(data);
  uintptr_t lo = UINTPTR_MAX;
  uintptr_t hi = 0;
  const void* eh_frame_hdr = nullptr;
  bool holds_pc = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD) {
      lo = start < lo ? start : lo;
      hi = start + ph.p_memsz > hi ? start + ph.p_memsz : hi;
      holds_pc = holds_pc || (q->pc >= start && q->pc < start + ph.p_memsz);
    } else if (ph.p_type == PT_GNU_EH_FRAME) {
      eh_frame_hdr = reinterpret_cast<const void*>(start);
    }
  }
  if (!holds_pc) {
    return 0;  // keep iterating
  }
  q->out->dlfo_flags = 0;
  q->out->dlfo_map_start = reinterpret_cast<void*>(lo);
  q->out->dlfo_map_end = reinterpret_cast<void*>(hi);
  q->out->dlfo_link_map = nullptr;  // filled below; libgcc reads only the two fields after it
  q->out->dlfo_eh_frame = const_cast<void*>(eh_frame_hdr);
  return 1;
}

}  // namespace

// The object holding pc and its PT_GNU_EH_FRAME (the .eh_frame_hdr libgcc binary-searches),
// found the way libgcc did before glibc 2.35: walking the loaded objects' program headers.
// Returns 0 when found, -1 otherwise, as glibc's _dl_find_object does.
extern "C" FH_COMPAT_PRIVATE int _dl_find_object(void* pc, dl_find_object* result) noexcept {
  FindQuery q{reinterpret_cast<uintptr_t>(pc), result};
  if (dl_iterate_phdr(find_object_of_pc, &q) == 0) {
    return -1;
  }
  Dl_info info;
  void* map = nullptr;
  if (dladdr1(pc, &info, &map, RTLD_DL_LINKMAP) != 0) {
    result->dlfo_link_map = static_cast<link_map*>(map);
  }
  return 0;
}

#endif  // DLFO_STRUCT_HAS_EH_DBASE
