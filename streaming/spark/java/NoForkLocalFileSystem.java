package lakestream.hadoop;

import java.io.File;
import java.io.IOException;
import java.io.InterruptedIOException;
import java.net.URI;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.HashSet;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's checksummed local file system, except that a file's permissions are set through Java
 * instead of a forked {@code chmod}. Without Hadoop's native library, {@link RawLocalFileSystem}
 * forks {@code chmod} for every file it creates (and its checksum file): ten processes per Iceberg
 * commit, ~4.5 ms each on a 2-core machine.
 *
 * <p>A stream's landing folders (the configuration's {@code lakestream.watch.folders}, comma-separated) are
 * listed only once they change. A stream that triggers as soon as its last batch committed lists its
 * folder again and again while no input arrives (Spark sleeps 10 ms between empty listings, and each one
 * reads every file's status): an idle stream kept ~30 % of a core busy. Here a listing of a watched folder
 * waits, checking the folder's modification time every {@code lakestream.watch.step.ms} (10 ms), until the
 * folder has changed since its last listing, or at most {@code lakestream.watch.max.ms} (1 s). A file renamed
 * or written into the folder changes its modification time, so a new file is seen within a step; a folder
 * whose last listing held subfolders (files landing below it change no time of its own) is listed as Hadoop
 * would. Everything else is Hadoop's own code.
 */
public class NoForkLocalFileSystem extends LocalFileSystem {
  public NoForkLocalFileSystem() {
    super(new Raw());
  }

  public static class Raw extends RawLocalFileSystem {
    /** Per watched folder (JVM-wide: file systems of streams are not cached): its modification time when it was
     *  last listed, and whether that listing held a folder. */
    private static final ConcurrentHashMap<String, long[]> LISTED = new ConcurrentHashMap<>();
    private Set<String> watched = new HashSet<>();
    private long stepMs = 10;
    private long maxMs = 1000;

    @Override
    public void initialize(URI uri, Configuration conf) throws IOException {
      super.initialize(uri, conf);
      for (String folder : conf.getTrimmedStrings("lakestream.watch.folders")) {
        watched.add(new File(folder).getAbsolutePath());
      }
      stepMs = Math.max(1, conf.getLong("lakestream.watch.step.ms", stepMs));
      maxMs = Math.max(0, conf.getLong("lakestream.watch.max.ms", maxMs));
    }

    @Override
    public FileStatus[] listStatus(Path f) throws IOException {
      if (watched.isEmpty()) {
        return super.listStatus(f);
      }
      File folder = pathToFile(f);
      String key = folder.getAbsolutePath();
      if (!watched.contains(key)) {
        return super.listStatus(f);
      }
      long[] last = LISTED.get(key);
      long changed = modified(folder);
      if (last != null && last[1] == 0) {
        long deadline = System.nanoTime() + maxMs * 1_000_000L;
        while (changed == last[0] && System.nanoTime() < deadline) {
          try {
            Thread.sleep(stepMs);
          } catch (InterruptedException e) {  // the query is being stopped
            Thread.currentThread().interrupt();
            throw new InterruptedIOException("listing of " + key + " interrupted");
          }
          changed = modified(folder);
        }
      }
      FileStatus[] listed = super.listStatus(f);
      long dirs = 0;
      for (FileStatus status : listed) {
        if (status.isDirectory()) {
          dirs = 1;
          break;
        }
      }
      LISTED.put(key, new long[] {changed, dirs});  // (the time read before listing: a file added meanwhile counts)
      return listed;
    }

    private static long modified(File folder) {
      try {
        return Files.getLastModifiedTime(folder.toPath()).to(java.util.concurrent.TimeUnit.NANOSECONDS);
      } catch (IOException e) {
        return -1;
      }
    }

    private static final PosixFilePermission[] BITS = {
      PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
      PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
      PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ,
    };

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      int mode = permission.toShort();
      if ((mode & ~0777) != 0) {  // sticky, setuid or setgid: leave those to Hadoop
        super.setPermission(p, permission);
        return;
      }
      Set<PosixFilePermission> bits = EnumSet.noneOf(PosixFilePermission.class);
      for (int i = 0; i < BITS.length; i++) {
        if ((mode & (1 << i)) != 0) {
          bits.add(BITS[i]);
        }
      }
      try {
        Files.setPosixFilePermissions(pathToFile(p).toPath(), bits);
      } catch (UnsupportedOperationException e) {  // a file system without POSIX permissions
        super.setPermission(p, permission);
      }
    }
  }
}
